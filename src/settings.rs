//! One definition per setting.
//!
//! [`settings!`](crate::settings!) declares a settings section once: each field with its
//! type, default and one doc line. From that one list it makes
//! - the section's config struct (serde, `deny_unknown_fields`, the defaults as `Default`),
//! - its flags struct (clap `Args`): one `--flag` per field, with the doc line and the default
//!   as help, every value optional, serialising only the flags that were given, so that the
//!   flags are simply the last layer over the file and the environment
//!   (see [`crate::config`]),
//! - the list of its keys ([`Section::keys`]), which the settings test walks to check that
//!   every key can be set by file, environment and flag and that `--help` shows it.
//!
//! Adding a setting is one field in one `settings!` block.

use serde::Serialize;
use std::path::PathBuf;

/// A value the types allow but the setting does not (a zero batch, a negative rate).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("config: `{key}` {reason}")]
pub struct InvalidSetting {
    /// `section.key`.
    pub key: String,
    pub reason: String,
}

/// An [`InvalidSetting`] for `key`.
pub fn invalid(key: &str, reason: impl Into<String>) -> InvalidSetting {
    InvalidSetting {
        key: key.to_string(),
        reason: reason.into(),
    }
}

/// A type a setting can have: what its flag parses into, and values to test it with.
pub trait Setting: Sized {
    /// The flag's value (`T` for an `Option<T>` setting: the flag itself is optional).
    type Flag;
    /// Some valid value of the type.
    fn sample() -> Self;
    /// A valid value different from `self`.
    fn other(&self) -> Self;
}

macro_rules! plain_settings {
    ($($t:ty => $sample:expr, |$v:ident| $other:expr;)*) => {$(
        impl Setting for $t {
            type Flag = $t;
            fn sample() -> Self { $sample }
            fn other(&self) -> Self { let $v = self; $other }
        }
    )*};
}

plain_settings! {
    u32 => 3, |v| v + 1;
    u64 => 3, |v| v + 1;
    usize => 3, |v| v + 1;
    f32 => 0.5, |v| if *v == 0.0 { 0.5 } else { v * 0.5 };
    f64 => 0.5, |v| if *v == 0.0 { 0.5 } else { v * 0.5 };
    bool => true, |v| !v;
    String => "sample".into(), |v| format!("{v}-other");
    PathBuf => PathBuf::from("sample"), |v| v.join("other");
}

impl<T: Setting<Flag = T>> Setting for Option<T> {
    type Flag = T;
    fn sample() -> Self {
        Some(T::sample())
    }
    fn other(&self) -> Self {
        Some(self.as_ref().map_or_else(T::sample, T::other))
    }
}

/// Implements [`Setting`] for a `clap::ValueEnum` (its flag takes the variant names).
#[macro_export]
macro_rules! enum_setting {
    ($t:ty) => {
        impl $crate::settings::Setting for $t {
            type Flag = $t;
            fn sample() -> Self {
                <$t as clap::ValueEnum>::value_variants()[0].clone()
            }
            fn other(&self) -> Self {
                let all = <$t as clap::ValueEnum>::value_variants();
                let at = all.iter().position(|v| v == self).unwrap_or(0);
                all[(at + 1) % all.len()].clone()
            }
        }
    };
}

/// One key of a section, for tests and documentation.
#[derive(Debug, Clone)]
pub struct Key {
    /// The key in the file (`group_size`); the flag is the same in kebab case.
    pub name: &'static str,
    /// The doc line.
    pub doc: &'static str,
    /// The default, as TOML (`None` when the setting is unset by default).
    pub default: Option<toml::Value>,
    /// Three valid values, as TOML: the first differs from the default and each from the
    /// one before it (a precedence test sets them in turn by file, environment and flag).
    pub others: [toml::Value; 3],
}

/// A settings section made by [`settings!`](crate::settings!).
pub trait Section {
    /// Its name in the file (`gen`), empty for the top level.
    const NAME: &'static str;
    /// Its keys, in definition order.
    fn keys() -> Vec<Key>;
}

/// A value as TOML, `None` for an unset optional value.
pub fn to_toml(v: &impl Serialize) -> Option<toml::Value> {
    toml::Value::try_from(v).ok()
}

/// A value as a flag or help text shows it (strings without quotes).
pub fn show(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => s.clone(),
        // An f32 setting arrives widened to f64: show it as the f32 it is (0.2, not
        // 0.20000000298023224).
        toml::Value::Float(f) if f64::from(*f as f32) == *f => (*f as f32).to_string(),
        toml::Value::Float(f) => f.to_string(),
        other => other.to_string(),
    }
}

/// Marks where help text ends and its default begins.
const DEFAULT_MARK: &str = " [default: ";

/// Help text: the doc line and, when set, the default.
pub fn help(doc: &str, default: &impl Serialize) -> String {
    with_default(doc, to_toml(default).as_ref())
}

/// `doc`, followed by `[default: v]` when `v` is given.
pub fn with_default(doc: &str, default: Option<&toml::Value>) -> String {
    let doc = doc.trim();
    match default {
        Some(v) => format!("{doc}{DEFAULT_MARK}{}]", show(v)),
        None => doc.to_string(),
    }
}

/// The doc line of a help text made by [`help`] (its default removed).
pub fn doc_of(help: &str) -> &str {
    help.rfind(DEFAULT_MARK).map_or(help, |at| &help[..at])
}

/// The flags that were given, as a config layer: the section's table (or the top level).
pub fn flag_layer(section: &str, flags: &impl Serialize) -> toml::Table {
    let given = match toml::Table::try_from(flags) {
        Ok(t) => t,
        // Every flag type serialises to TOML; an empty layer is the only other outcome.
        Err(_) => toml::Table::new(),
    };
    if section.is_empty() {
        given
    } else {
        let mut t = toml::Table::new();
        if !given.is_empty() {
            t.insert(section.to_string(), toml::Value::Table(given));
        }
        t
    }
}

/// The clap id of a setting's flag: `section.key` (`.key` at the top level), so flags of
/// different sections never collide inside one command.
pub fn flag_id(section: &str, key: &str) -> String {
    format!("{section}.{key}")
}

/// Declares a settings section once; see the [module docs](crate::settings).
///
/// ```ignore
/// settings! {
///     /// The `[gen]` section.
///     pub struct GenConfig, flags GenArgs, section "gen" {
///         /// Completions per prompt (G).
///         pub group_size: usize = 8,
///     }
/// }
/// ```
/// A field may carry extra `#[arg(...)]` attributes for its flag (`value_name`,
/// `num_args`); sections nested in the file (not flags) follow in `sections { ... }`.
#[macro_export]
macro_rules! settings {
    (
        $(#[$meta:meta])*
        pub struct $name:ident, flags $args:ident, section $section:literal {
            $(
                $(#[doc = $doc:literal])+
                $(#[arg($($arg:tt)*)])*
                pub $field:ident : $ty:ty = $default:expr,
            )*
        }
        $(sections {
            $(
                $(#[$smeta:meta])*
                pub $sfield:ident : $sty:ty,
            )*
        })?
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
        #[serde(deny_unknown_fields, default)]
        pub struct $name {
            $( $(#[doc = $doc])+ pub $field: $ty, )*
            $($( $(#[$smeta])* pub $sfield: $sty, )*)?
        }

        impl Default for $name {
            fn default() -> Self {
                Self {
                    $( $field: $default, )*
                    $($( $sfield: Default::default(), )*)?
                }
            }
        }

        #[doc = concat!("The flags of [`", stringify!($name), "`]; each one given overrides the file and the environment.")]
        #[derive(Debug, Clone, Default, clap::Args, serde::Serialize)]
        pub struct $args {
            $(
                #[arg(
                    id = concat!($section, ".", stringify!($field)),
                    long = stringify!($field).replace('_', "-"),
                    value_name = stringify!($field).to_uppercase(),
                    help = $crate::settings::help(
                        concat!($($doc),+),
                        &<$name as Default>::default().$field,
                    ),
                )]
                $(#[arg($($arg)*)])*
                #[serde(skip_serializing_if = "Option::is_none")]
                pub $field: Option<<$ty as $crate::settings::Setting>::Flag>,
            )*
        }

        impl $args {
            /// The flags that were given, as a config layer.
            pub fn layer(&self) -> toml::Table {
                $crate::settings::flag_layer($section, self)
            }

            /// `base` with the flags that were given, for a command without a file layer.
            pub fn over(&self, base: &$name) -> $name {
                let mut c = base.clone();
                $( if let Some(v) = &self.$field { c.$field = v.clone().into(); } )*
                c
            }
        }

        impl $crate::settings::Section for $name {
            const NAME: &'static str = $section;
            fn keys() -> Vec<$crate::settings::Key> {
                let d = <$name as Default>::default();
                vec![$(
                    $crate::settings::Key {
                        name: stringify!($field),
                        doc: concat!($($doc),+),
                        default: $crate::settings::to_toml(&d.$field),
                        others: {
                            use $crate::settings::Setting;
                            let a = d.$field.other();
                            let b = a.other();
                            let c = b.other();
                            [a, b, c].map(|v| {
                                $crate::settings::to_toml(&v).expect("a set value serialises")
                            })
                        },
                    },
                )*]
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn help_keeps_the_doc_and_shows_the_default() {
        let h = help(" Completions per prompt.", &8usize);
        assert_eq!(h, "Completions per prompt. [default: 8]");
        assert_eq!(doc_of(&h), "Completions per prompt.");
        assert_eq!(help("A file.", &None::<PathBuf>), "A file.");
        assert_eq!(help("Dir.", &PathBuf::from("ckpt")), "Dir. [default: ckpt]");
        assert_eq!(help("Clip.", &0.2f32), "Clip. [default: 0.2]");
        assert_eq!(help("Rate.", &5e-4f64), "Rate. [default: 0.0005]");
    }

    #[test]
    fn other_values_differ() {
        assert_ne!(0.0f32.other(), 0.0);
        assert_ne!(None::<u64>.other(), None);
        assert_ne!(Some(3u64).other(), Some(3));
        assert!(!true.other());
    }
}
