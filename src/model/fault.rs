//! Failure containment around forward passes, and the fault-injection hook that proves it.
//!
//! Validation ([`Limits`](crate::schema::Limits)) refuses what a model cannot run before any
//! tensor is built, so a forward pass that panics is a bug. When one does, the stage that
//! ran it catches the panic, finds the message that caused it by re-running the pass one
//! message at a time, dead-letters that message with reason `panic`, and goes on.
//!
//! `RLSTREAM_FAULT_PANIC_ON=ID` makes every forward pass that includes the group (or the
//! prompt) with id `ID` panic, in gen and in train: the only way to reach that path once
//! validation is complete. It exists for the containment tests; nothing sets it otherwise.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::OnceLock;

/// Dead-letter reason of a message whose forward pass panicked (gen and train).
pub const PANIC: &str = "panic";

/// The environment variable naming the group or prompt whose forward passes panic.
pub const FAULT_ENV: &str = "RLSTREAM_FAULT_PANIC_ON";

fn chosen() -> Option<&'static str> {
    static CHOSEN: OnceLock<Option<String>> = OnceLock::new();
    CHOSEN
        .get_or_init(|| std::env::var(FAULT_ENV).ok().filter(|v| !v.is_empty()))
        .as_deref()
}

/// Panics when one of `ids` (group or prompt ids of the messages in a pass) is the one
/// [`FAULT_ENV`] names.
pub fn inject<'a>(mut ids: impl Iterator<Item = &'a str>) {
    if let Some(target) = chosen()
        && ids.any(|id| id == target)
    {
        panic!("injected fault ({FAULT_ENV}={target})");
    }
}

/// Runs `f`, turning a panic into `Err` with the panic's message.
pub fn contain<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        p.downcast_ref::<&str>()
            .map(|s| (*s).to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".into())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_its_message() {
        assert_eq!(contain(|| 3), Ok(3));
        assert_eq!(
            contain(|| -> u8 { panic!("index 128 out of bounds") }),
            Err("index 128 out of bounds".to_string())
        );
        let n = 7;
        assert_eq!(
            contain(|| -> u8 { panic!("row {n}") }),
            Err("row 7".to_string())
        );
    }
}
