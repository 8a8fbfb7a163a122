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

/// How the runner builds and runs a language's program (its source is written to a fresh
/// per-exec directory; the exec's arguments follow the run command).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Build {
    /// Runs in the persistent Python kernel, not as a program.
    Kernel,
    /// `INTERPRETER DIR/SOURCE ARGS`.
    Script {
        /// The file name the source is written to.
        source: &'static str,
        /// The interpreter, found on the sandbox's `PATH`.
        interpreter: &'static str,
    },
    /// `COMPILE...` in the per-exec directory, which must make `prog`; then `DIR/prog ARGS`.
    Native {
        /// The file name the source is written to.
        source: &'static str,
        /// The compiler command.
        compile: &'static [&'static str],
    },
    /// Built by code of its own in the runner's build plans (TypeScript, Java).
    Custom,
}

/// What the project knows about one language, in one place: the names clients may use,
/// how it is built, and a sample program. The broker's descriptions for models, its
/// `smoke` check, the tests and the playground all read this table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LanguageSpec {
    /// The language this entry is about.
    pub language: Language,
    /// The short name clients send and the protocol uses (`py`, `js`, ...).
    pub name: &'static str,
    /// The name people know it by, for descriptions ("Python", "C++").
    pub title: &'static str,
    /// Other names accepted for it, lower case (matched case-insensitively).
    pub aliases: &'static [&'static str],
    /// Whether a compiler runs before the program.
    pub compiled: bool,
    /// How the runner builds and runs it.
    pub build: Build,
    /// Whether the runner's compile cache keeps what the compiler left in the per-exec
    /// directory, keyed by `name`, the source file, the compiler command and the code.
    pub cache_compile: bool,
    /// A program that prints [`LanguageSpec::hello_line`] and nothing else: the sample of
    /// the `smoke` check, the tests and the playground.
    pub hello: &'static str,
}

impl LanguageSpec {
    /// The one line [`LanguageSpec::hello`] prints: `hello from <name>`.
    pub fn hello_line(&self) -> String {
        format!("hello from {}", self.name)
    }
}

/// Every language, in LibreChat's order (the order of [`Language`]'s variants).
pub const LANGUAGES: [LanguageSpec; 13] = [
    LanguageSpec {
        language: Language::Py,
        name: "py",
        title: "Python",
        aliases: &["python", "python3"],
        compiled: false,
        build: Build::Kernel,
        cache_compile: false,
        hello: "print('hello from py')",
    },
    LanguageSpec {
        language: Language::Js,
        name: "js",
        title: "JavaScript",
        aliases: &["javascript", "node", "nodejs"],
        compiled: false,
        build: Build::Script {
            source: "main.js",
            interpreter: "node",
        },
        cache_compile: false,
        hello: "console.log('hello from js')",
    },
    LanguageSpec {
        language: Language::Ts,
        name: "ts",
        title: "TypeScript",
        aliases: &["typescript"],
        compiled: true,
        build: Build::Custom,
        cache_compile: false,
        hello: "const who: string = 'ts';\nconsole.log(`hello from ${who}`);",
    },
    LanguageSpec {
        language: Language::C,
        name: "c",
        title: "C",
        aliases: &[],
        compiled: true,
        build: Build::Native {
            source: "main.c",
            compile: &["gcc", "-O2", "-o", "prog", "main.c", "-lm"],
        },
        cache_compile: true,
        hello: "#include <stdio.h>\nint main(void) { printf(\"hello from c\\n\"); return 0; }",
    },
    LanguageSpec {
        language: Language::Cpp,
        name: "cpp",
        title: "C++",
        aliases: &["c++", "cxx"],
        compiled: true,
        build: Build::Native {
            source: "main.cpp",
            compile: &["g++", "-O2", "-std=c++17", "-o", "prog", "main.cpp"],
        },
        cache_compile: true,
        hello: "#include <iostream>\nint main() { std::cout << \"hello from cpp\" << std::endl; }",
    },
    LanguageSpec {
        language: Language::Java,
        name: "java",
        title: "Java",
        aliases: &[],
        compiled: true,
        build: Build::Custom,
        cache_compile: true,
        hello: "public class Greeter {\n  public static void main(String[] a) { System.out.println(\"hello from java\"); }\n}",
    },
    LanguageSpec {
        language: Language::Php,
        name: "php",
        title: "PHP",
        aliases: &[],
        compiled: false,
        build: Build::Script {
            source: "main.php",
            interpreter: "php",
        },
        cache_compile: false,
        hello: "<?php echo \"hello from php\\n\";",
    },
    LanguageSpec {
        language: Language::Rs,
        name: "rs",
        title: "Rust",
        aliases: &["rust"],
        compiled: true,
        build: Build::Native {
            source: "main.rs",
            compile: &["rustc", "--edition", "2021", "-o", "prog", "main.rs"],
        },
        cache_compile: true,
        hello: "fn main() { println!(\"hello from rs\"); }",
    },
    LanguageSpec {
        language: Language::Go,
        name: "go",
        title: "Go",
        aliases: &["golang"],
        compiled: true,
        build: Build::Native {
            source: "main.go",
            compile: &["go", "build", "-o", "prog", "main.go"],
        },
        cache_compile: true,
        hello: "package main\nimport \"fmt\"\nfunc main() { fmt.Println(\"hello from go\") }",
    },
    LanguageSpec {
        language: Language::D,
        name: "d",
        title: "D",
        aliases: &["dlang"],
        compiled: true,
        build: Build::Native {
            source: "main.d",
            compile: &["gdc", "-o", "prog", "main.d"],
        },
        cache_compile: true,
        hello: "import std.stdio;\nvoid main() { writeln(\"hello from d\"); }",
    },
    LanguageSpec {
        language: Language::F90,
        name: "f90",
        title: "Fortran",
        aliases: &["fortran"],
        compiled: true,
        build: Build::Native {
            source: "main.f90",
            compile: &["gfortran", "-o", "prog", "main.f90"],
        },
        cache_compile: true,
        hello: "program hello\n  print '(a)', 'hello from f90'\nend program hello",
    },
    LanguageSpec {
        language: Language::R,
        name: "r",
        title: "R",
        aliases: &[],
        compiled: false,
        build: Build::Script {
            source: "main.r",
            interpreter: "Rscript",
        },
        cache_compile: false,
        hello: "cat('hello from r\\n')",
    },
    LanguageSpec {
        language: Language::Bash,
        name: "bash",
        title: "Bash",
        aliases: &["sh", "shell"],
        compiled: false,
        build: Build::Script {
            source: "main.sh",
            interpreter: "bash",
        },
        cache_compile: false,
        hello: "echo hello from bash",
    },
];

impl Language {
    /// Every language, in LibreChat's order.
    pub const ALL: [Language; LANGUAGES.len()] = {
        let mut all = [Language::Py; LANGUAGES.len()];
        let mut i = 0;
        while i < LANGUAGES.len() {
            all[i] = LANGUAGES[i].language;
            i += 1;
        }
        all
    };

    /// This language's entry in [`LANGUAGES`].
    pub fn spec(self) -> &'static LanguageSpec {
        // The table follows the variants' order (checked by a test).
        &LANGUAGES[self as usize]
    }

    /// The short name LibreChat sends (`py`, `js`, ...).
    pub fn as_str(self) -> &'static str {
        self.spec().name
    }

    /// The short names for a description, `last` before the final one:
    /// `py, js, ..., r or bash` with `" or "`.
    pub fn names(last: &str) -> String {
        join(LANGUAGES.iter().map(|l| l.name.to_string()), last)
    }

    /// The short names with the name people know each by, where that differs:
    /// `py (Python), js (JavaScript), ..., c, cpp (C++), ..., r or bash`.
    pub fn names_explained() -> String {
        let names = LANGUAGES.iter().map(|l| {
            if l.title.eq_ignore_ascii_case(l.name) {
                l.name.to_string()
            } else {
                format!("{} ({})", l.name, l.title)
            }
        });
        join(names, " or ")
    }

    /// The names people know the languages by: `Python, JavaScript, ..., R and Bash`.
    pub fn titles() -> String {
        join(LANGUAGES.iter().map(|l| l.title.to_string()), " and ")
    }
}

/// `a, b, c` with `last` between the last two.
fn join(items: impl Iterator<Item = String>, last: &str) -> String {
    let items: Vec<String> = items.collect();
    match items.split_last() {
        Some((final_item, rest)) if !rest.is_empty() => {
            format!("{}{last}{final_item}", rest.join(", "))
        }
        _ => items.concat(),
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
        let wanted = s.trim().to_ascii_lowercase();
        LANGUAGES
            .iter()
            .find(|l| l.name == wanted || l.aliases.contains(&wanted.as_str()))
            .map(|l| l.language)
            .ok_or_else(|| UnknownLanguage(s.to_string()))
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
    fn the_table_follows_the_variants() {
        for (i, spec) in LANGUAGES.iter().enumerate() {
            assert_eq!(spec.language as usize, i, "{}", spec.name);
            assert_eq!(spec.language.spec(), spec);
            assert!(spec.hello.contains(&spec.hello_line()) || spec.language == Language::Ts);
            assert!(spec.compiled || !spec.cache_compile, "{}", spec.name);
            for alias in spec.aliases {
                assert_eq!(alias.parse::<Language>(), Ok(spec.language));
            }
        }
    }

    #[test]
    fn descriptions_list_every_language() {
        assert_eq!(
            Language::names(" or "),
            "py, js, ts, c, cpp, java, php, rs, go, d, f90, r or bash"
        );
        assert_eq!(
            Language::names(", "),
            "py, js, ts, c, cpp, java, php, rs, go, d, f90, r, bash"
        );
        assert_eq!(
            Language::names_explained(),
            "py (Python), js (JavaScript), ts (TypeScript), c, cpp (C++), java, php, \
             rs (Rust), go, d, f90 (Fortran), r or bash"
        );
        assert_eq!(
            Language::titles(),
            "Python, JavaScript, TypeScript, C, C++, Java, PHP, Rust, Go, D, Fortran, R and Bash"
        );
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
