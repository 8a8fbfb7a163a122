//! The build plan of one exec: how its program is compiled and run, from the language
//! table's [`Build`] (the README's table), with TypeScript and Java built by code here.

use sandbox_runner::language::Build;
use sandbox_runner::Language;
use std::path::Path;

/// The steps of one non-Python exec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The file name the source is written to, in the per-exec directory.
    pub source: String,
    /// The compiler command, run in the per-exec directory; `None` for interpreters.
    pub compile: Option<Vec<String>>,
    /// The program command (the exec's arguments are appended), run in the workspace.
    pub run: Vec<String>,
}

/// The plan for `lang`, with `dir` the per-exec directory; `None` for Python, which runs
/// in the kernel.
pub fn plan(lang: Language, code: &str, dir: &Path) -> Option<Plan> {
    let in_dir = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let strs = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let native = |source: &str, compile: &[&str]| Plan {
        source: source.into(),
        compile: Some(strs(compile)),
        run: vec![in_dir("prog")],
    };
    let script = |source: &str, interpreter: &str| Plan {
        source: source.into(),
        compile: None,
        run: vec![interpreter.into(), in_dir(source)],
    };
    let custom = match lang.spec().build {
        Build::Kernel => return None,
        Build::Script {
            source,
            interpreter,
        } => return Some(script(source, interpreter)),
        Build::Native { source, compile } => return Some(native(source, compile)),
        Build::Custom => lang,
    };
    Some(match custom {
        Language::Ts => Plan {
            source: "main.ts".into(),
            compile: Some(strs(&[
                "esbuild",
                "main.ts",
                "--outfile=main.js",
                "--format=cjs",
                "--platform=node",
                "--log-level=warning",
            ])),
            run: vec!["node".into(), in_dir("main.js")],
        },
        Language::Java => {
            let (file, class) = java_names(code);
            let source = format!("{file}.java");
            Plan {
                compile: Some(vec!["javac".into(), source.clone()]),
                source,
                run: vec![
                    "java".into(),
                    "-cp".into(),
                    dir.to_string_lossy().into_owned(),
                    class,
                ],
            }
        }
        // The table gives every other language a build of its own kind.
        _ => return None,
    })
}

/// The compiled TypeScript module of an exec with tools: it runs as an ES module, for
/// top-level `await` (esbuild cannot put that into CommonJS); `None` for other languages.
pub fn esm_main(lang: Language, dir: &Path) -> Option<String> {
    (lang == Language::Ts).then(|| dir.join("main.mjs").to_string_lossy().into_owned())
}

/// Changes a JavaScript or TypeScript plan so node preloads the tool functions from
/// `prelude` (`node -r PRELUDE main.js`). TypeScript is compiled to an ES module
/// (`main.mjs`, see [`esm_main`]); plain JavaScript stays CommonJS, and the caller wraps
/// it in an async function instead. Other languages are left alone.
pub fn preload(plan: &mut Plan, lang: Language, dir: &Path, prelude: &Path) {
    let main = match lang {
        Language::Js => dir.join("main.js").to_string_lossy().into_owned(),
        Language::Ts => match esm_main(lang, dir) {
            Some(m) => m,
            None => return,
        },
        _ => return,
    };
    if lang == Language::Ts {
        if let Some(compile) = plan.compile.as_mut() {
            for arg in compile.iter_mut() {
                if arg == "--outfile=main.js" {
                    *arg = "--outfile=main.mjs".into();
                } else if arg == "--format=cjs" {
                    *arg = "--format=esm".into();
                }
            }
        }
    }
    plan.run = vec![
        "node".into(),
        "-r".into(),
        prelude.to_string_lossy().into_owned(),
        main,
    ];
}

/// One top-level type declaration found in Java source.
#[derive(Debug)]
struct JavaType {
    /// Its name.
    name: String,
    /// Whether it is `public` (then the file must be named after it).
    public: bool,
    /// Whether its body declares `void main(`.
    has_main: bool,
}

/// The file stem and the class to run for Java source: the file is named after the public
/// top-level type (javac insists), else `Main`; the class run is the first top-level type
/// with a `main` method, else the public one, else the first, else `Main`.
pub fn java_names(code: &str) -> (String, String) {
    let types = java_types(code);
    let public = types.iter().find(|t| t.public).map(|t| t.name.clone());
    let run = types
        .iter()
        .find(|t| t.has_main)
        .map(|t| t.name.clone())
        .or_else(|| public.clone())
        .or_else(|| types.first().map(|t| t.name.clone()))
        .unwrap_or_else(|| "Main".into());
    (public.unwrap_or_else(|| "Main".into()), run)
}

/// Finds the top-level type declarations, skipping comments and literals and tracking
/// brace depth so nested types do not count.
fn java_types(code: &str) -> Vec<JavaType> {
    let tokens = java_tokens(code);
    let mut types: Vec<JavaType> = Vec::new();
    let mut depth = 0usize;
    // Depth-0 tokens since the last `;`, `{` or `}`: the modifiers of a declaration.
    let mut modifiers: Vec<&str> = Vec::new();
    for (i, tok) in tokens.iter().enumerate() {
        match tok.as_str() {
            "{" => {
                depth += 1;
                modifiers.clear();
            }
            "}" => {
                depth = depth.saturating_sub(1);
                modifiers.clear();
            }
            ";" => modifiers.clear(),
            "class" | "interface" | "enum" | "record" if depth == 0 => {
                if let Some(name) = tokens.get(i + 1).filter(|n| is_ident(n)) {
                    types.push(JavaType {
                        name: name.clone(),
                        public: modifiers.contains(&"public"),
                        has_main: false,
                    });
                }
                modifiers.clear();
            }
            "main" if depth == 1 => {
                let before = i.checked_sub(1).and_then(|j| tokens.get(j));
                let after = tokens.get(i + 1);
                if before.is_some_and(|t| t == "void") && after.is_some_and(|t| t == "(") {
                    if let Some(t) = types.last_mut() {
                        t.has_main = true;
                    }
                }
            }
            t if depth == 0 => modifiers.push(t),
            _ => {}
        }
    }
    types
}

fn is_ident(s: &str) -> bool {
    s.chars()
        .next()
        .is_some_and(|c| c.is_alphabetic() || c == '_' || c == '$')
        && s.chars()
            .all(|c| c.is_alphanumeric() || c == '_' || c == '$')
}

/// Splits Java source into identifiers and single punctuation characters, dropping
/// whitespace, comments and string, text block and char literals.
fn java_tokens(code: &str) -> Vec<String> {
    let chars: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c.is_whitespace() {
            i += 1;
        } else if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            i += 2;
            while i < chars.len() && !(chars[i] == '*' && chars.get(i + 1) == Some(&'/')) {
                i += 1;
            }
            i += 2;
        } else if c == '"' && next == Some('"') && chars.get(i + 2) == Some(&'"') {
            i += 3;
            while i < chars.len() && !chars[i..].starts_with(&['"', '"', '"']) {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 3;
        } else if c == '"' || c == '\'' {
            i += 1;
            while i < chars.len() && chars[i] != c && chars[i] != '\n' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
        } else if c.is_alphanumeric() || c == '_' || c == '$' {
            let start = i;
            while i < chars.len()
                && (chars[i].is_alphanumeric() || chars[i] == '_' || chars[i] == '$')
            {
                i += 1;
            }
            out.push(chars[start..i].iter().collect());
        } else {
            out.push(c.to_string());
            i += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(code: &str) -> (String, String) {
        let (a, b) = java_names(code);
        (a, b)
    }

    #[test]
    fn public_class_names_the_file() {
        let code = "import java.util.*;\npublic class Hello {\n  public static void main(String[] a) {}\n}";
        assert_eq!(names(code), ("Hello".into(), "Hello".into()));
        let code = "@SuppressWarnings(\"x\") public final class Gen<T> { public static void main(String[] a){} }";
        assert_eq!(names(code), ("Gen".into(), "Gen".into()));
    }

    #[test]
    fn no_public_class_means_main_file_and_the_class_with_main() {
        let code = "class Helper {}\nclass Prog { static void main(String[] args) {} }";
        assert_eq!(names(code), ("Main".into(), "Prog".into()));
        assert_eq!(names(""), ("Main".into(), "Main".into()));
        assert_eq!(names("class Only {}"), ("Main".into(), "Only".into()));
    }

    #[test]
    fn nested_comments_and_strings_do_not_count() {
        let code = r#"
            // public class Commented {}
            /* public class Block {} */
            class Main {
                String s = "public class InString {";
                char c = '{';
                String t = """
                    public class InTextBlock { "quoted" }
                    """;
                public static class Nested { public static void main(String[] a) {} }
                public static void main(String[] args) { System.out.println("}"); }
            }
        "#;
        assert_eq!(names(code), ("Main".into(), "Main".into()));
    }

    #[test]
    fn public_type_without_main() {
        let code =
            "public interface Shape {}\nclass App { public static void main(String[] a) {} }";
        assert_eq!(names(code), ("Shape".into(), "App".into()));
    }

    #[test]
    fn preloading_tools() {
        let dir = Path::new("/tmp/exec-1");
        let prelude = Path::new("/tmp/tools-1/prelude.js");
        let mut p = plan(Language::Js, "", dir).unwrap();
        preload(&mut p, Language::Js, dir, prelude);
        assert_eq!(
            p.run,
            vec![
                "node",
                "-r",
                "/tmp/tools-1/prelude.js",
                "/tmp/exec-1/main.js"
            ]
        );
        let mut p = plan(Language::Ts, "", dir).unwrap();
        preload(&mut p, Language::Ts, dir, prelude);
        assert_eq!(
            p.run,
            vec![
                "node",
                "-r",
                "/tmp/tools-1/prelude.js",
                "/tmp/exec-1/main.mjs"
            ]
        );
        let compile = p.compile.unwrap();
        assert!(compile.contains(&"--outfile=main.mjs".to_string()));
        assert!(compile.contains(&"--format=esm".to_string()));
        let mut p = plan(Language::Bash, "", dir).unwrap();
        let before = p.clone();
        preload(&mut p, Language::Bash, dir, prelude);
        assert_eq!(p, before);
    }

    #[test]
    fn every_plan_from_the_table() {
        let dir = Path::new("/tmp/exec-1");
        let line = |lang| {
            let p = plan(lang, "", dir).unwrap();
            let compile = p.compile.map(|c| c.join(" ")).unwrap_or_default();
            format!("{} | {compile} | {}", p.source, p.run.join(" "))
        };
        let want = [
            (Language::Js, "main.js |  | node /tmp/exec-1/main.js"),
            (
                Language::Ts,
                "main.ts | esbuild main.ts --outfile=main.js --format=cjs --platform=node \
                 --log-level=warning | node /tmp/exec-1/main.js",
            ),
            (
                Language::C,
                "main.c | gcc -O2 -o prog main.c -lm | /tmp/exec-1/prog",
            ),
            (
                Language::Cpp,
                "main.cpp | g++ -O2 -std=c++17 -o prog main.cpp | /tmp/exec-1/prog",
            ),
            (
                Language::Java,
                "Main.java | javac Main.java | java -cp /tmp/exec-1 Main",
            ),
            (Language::Php, "main.php |  | php /tmp/exec-1/main.php"),
            (
                Language::Rs,
                "main.rs | rustc --edition 2021 -o prog main.rs | /tmp/exec-1/prog",
            ),
            (
                Language::Go,
                "main.go | go build -o prog main.go | /tmp/exec-1/prog",
            ),
            (
                Language::D,
                "main.d | gdc -o prog main.d | /tmp/exec-1/prog",
            ),
            (
                Language::F90,
                "main.f90 | gfortran -o prog main.f90 | /tmp/exec-1/prog",
            ),
            (Language::R, "main.r |  | Rscript /tmp/exec-1/main.r"),
            (Language::Bash, "main.sh |  | bash /tmp/exec-1/main.sh"),
        ];
        for (lang, want) in want {
            assert_eq!(line(lang), want, "{lang}");
            assert_eq!(lang.spec().compiled, want.split(" | ").nth(1) != Some(""));
        }
    }

    #[test]
    fn plans_use_absolute_paths_for_running() {
        let dir = Path::new("/tmp/exec-1");
        let p = plan(Language::C, "", dir).unwrap();
        assert_eq!(p.run, vec!["/tmp/exec-1/prog"]);
        assert_eq!(p.compile.unwrap()[0], "gcc");
        let p = plan(Language::Java, "public class X {}", dir).unwrap();
        assert_eq!(p.source, "X.java");
        assert_eq!(p.run, vec!["java", "-cp", "/tmp/exec-1", "X"]);
        assert!(plan(Language::Py, "", dir).is_none());
        for lang in Language::ALL {
            if lang != Language::Py {
                assert!(!plan(lang, "", dir).unwrap().run.is_empty());
            }
        }
    }
}
