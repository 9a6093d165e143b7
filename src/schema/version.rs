//! The schema version every message carries.

use serde::{Deserialize, Serialize};
use std::fmt;

/// `[major, minor]` on the wire. A reader accepts any minor of its major (new fields are
/// ignored) and refuses a newer major, whose meaning it cannot know.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(from = "(u16, u16)", into = "(u16, u16)")]
pub struct SchemaVersion {
    pub major: u16,
    pub minor: u16,
}

impl SchemaVersion {
    /// What this build writes.
    pub const CURRENT: SchemaVersion = SchemaVersion { major: 1, minor: 0 };
}

impl From<(u16, u16)> for SchemaVersion {
    fn from((major, minor): (u16, u16)) -> Self {
        SchemaVersion { major, minor }
    }
}

impl From<SchemaVersion> for (u16, u16) {
    fn from(v: SchemaVersion) -> Self {
        (v.major, v.minor)
    }
}

impl Default for SchemaVersion {
    fn default() -> Self {
        SchemaVersion::CURRENT
    }
}

impl fmt::Display for SchemaVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}
