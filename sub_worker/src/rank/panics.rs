//! Where the last panic happened, so the error sent to the parent names it.

use std::sync::{Mutex, PoisonError};

pub(super) static LAST_PANIC: Mutex<Option<String>> = Mutex::new(None);

/// Records where the last panic happened, so the error sent to the parent names it.
pub(super) fn install_panic_capture() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let location = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        *LAST_PANIC.lock().unwrap_or_else(PoisonError::into_inner) = Some(location);
        default(info);
    }));
}

pub(super) fn panic_text(payload: &Box<dyn std::any::Any + Send>) -> String {
    let msg = rankexec_protocol::panic_message(payload.as_ref());
    let location = LAST_PANIC
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take()
        .unwrap_or_default();
    format!("panicked{location}: {msg}")
}
