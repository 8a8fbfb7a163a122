//! What the events of a rich exec (`ExecInput::rich`) carry, for the front ends that show
//! values as notebooks do (E2B's interpreter, Jupyter's protocol): the kernel's two MIME
//! types (sandbox-image/kernels/kernel_rich.py), and the exception named by a traceback
//! the kernel could not send as an event.

/// A shown value: `{"main": bool, "data": {mime: value}}`, binary values base64; `main`
/// is the cell's trailing expression.
pub(crate) const BUNDLE_MIME: &str = "application/x.codebroker-bundle+json";

/// The cell's uncaught exception: `{"name", "value", "traceback"}`, the traceback one
/// string.
pub(crate) const ERROR_MIME: &str = "application/x.codebroker-error+json";

/// The exception's class name and message from the last line of a Python traceback.
pub(crate) fn python_exception(stderr: &str) -> Option<(String, String)> {
    let last = stderr.lines().rev().find(|l| !l.trim().is_empty())?;
    if last.starts_with(' ') {
        return None;
    }
    let (name, value) = last.split_once(": ").unwrap_or((last, ""));
    let name = name.trim();
    let valid = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_alphanumeric() || c == '_' || c == '.');
    valid.then(|| {
        let short = name.rsplit('.').next().unwrap_or(name);
        (short.to_string(), value.to_string())
    })
}

/// The last `max` bytes of `text`, on a character boundary.
pub(crate) fn tail(text: &str, max: usize) -> String {
    let mut start = text.len().saturating_sub(max);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    text[start..].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceback_names_its_exception() {
        let tb = "Traceback (most recent call last):\n  File \"<cell>\", line 1\nZeroDivisionError: division by zero\n";
        assert_eq!(
            python_exception(tb),
            Some((
                "ZeroDivisionError".to_string(),
                "division by zero".to_string()
            ))
        );
        assert_eq!(
            python_exception("pandas.errors.ParserError: bad\n"),
            Some(("ParserError".to_string(), "bad".to_string()))
        );
        assert_eq!(
            python_exception("KeyboardInterrupt\n").map(|e| e.0),
            Some("KeyboardInterrupt".to_string())
        );
        assert_eq!(python_exception("some words: here\n"), None);
    }

    #[test]
    fn a_tail_keeps_whole_characters() {
        assert_eq!(tail("héllo", 4), "llo");
        assert_eq!(tail("abc", 10), "abc");
    }
}
