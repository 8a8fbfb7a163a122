//! The languages a sandbox runs, with the names clients use for them.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// One of LibreChat's 13 code interpreter languages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Language {
    Py,
    Js,
    Ts,
    C,
    Cpp,
    Java,
    Php,
    Rs,
    Go,
    D,
    F90,
    R,
    Bash,
}

impl Language {
    /// Every language, in LibreChat's order.
    pub const ALL: [Language; 13] = [
        Language::Py,
        Language::Js,
        Language::Ts,
        Language::C,
        Language::Cpp,
        Language::Java,
        Language::Php,
        Language::Rs,
        Language::Go,
        Language::D,
        Language::F90,
        Language::R,
        Language::Bash,
    ];

    /// The short name LibreChat sends (`py`, `js`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Language::Py => "py",
            Language::Js => "js",
            Language::Ts => "ts",
            Language::C => "c",
            Language::Cpp => "cpp",
            Language::Java => "java",
            Language::Php => "php",
            Language::Rs => "rs",
            Language::Go => "go",
            Language::D => "d",
            Language::F90 => "f90",
            Language::R => "r",
            Language::Bash => "bash",
        }
    }
}

impl fmt::Display for Language {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The name was not one of the 13 languages or their aliases.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownLanguage(pub String);

impl fmt::Display for UnknownLanguage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Unsupported language: {}", self.0)
    }
}

impl std::error::Error for UnknownLanguage {}

impl FromStr for Language {
    type Err = UnknownLanguage;

    /// Accepts LibreChat's short names and the common long names, case-insensitively.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lang = match s.trim().to_ascii_lowercase().as_str() {
            "py" | "python" | "python3" => Language::Py,
            "js" | "javascript" | "node" | "nodejs" => Language::Js,
            "ts" | "typescript" => Language::Ts,
            "c" => Language::C,
            "cpp" | "c++" | "cxx" => Language::Cpp,
            "java" => Language::Java,
            "php" => Language::Php,
            "rs" | "rust" => Language::Rs,
            "go" | "golang" => Language::Go,
            "d" | "dlang" => Language::D,
            "f90" | "fortran" => Language::F90,
            "r" => Language::R,
            "bash" | "sh" | "shell" => Language::Bash,
            _ => return Err(UnknownLanguage(s.to_string())),
        };
        Ok(lang)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_names_round_trip() {
        for lang in Language::ALL {
            assert_eq!(lang.as_str().parse::<Language>(), Ok(lang));
            let json = serde_json::to_string(&lang).unwrap();
            assert_eq!(json, format!("\"{}\"", lang.as_str()));
        }
    }

    #[test]
    fn aliases_and_unknown_names() {
        assert_eq!("Python".parse::<Language>(), Ok(Language::Py));
        assert_eq!("typescript".parse::<Language>(), Ok(Language::Ts));
        assert_eq!("sh".parse::<Language>(), Ok(Language::Bash));
        let err = "cobol".parse::<Language>().unwrap_err();
        assert_eq!(err.to_string(), "Unsupported language: cobol");
    }
}
