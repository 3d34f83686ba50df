//! Example components (filled in below as the examples land).

use rankexec_protocol::Registry;

/// Every example component.
pub fn registry() -> Registry {
    Registry::new()
}
