//! This machine's host name, read in one place: for worker environments and log prefixes
//! (`${hostname}`), the node identity in a rendezvous registration, and GPU reports.

/// The full host name; `localhost` when the kernel's name is unreadable or not UTF-8.
pub fn name() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "localhost".to_owned())
}

/// The host name up to the first dot (what torchrun's `${hostname}` gives).
pub fn short_name() -> String {
    let name = name();
    name.split('.').next().unwrap_or(&name).to_owned()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_short_name_is_a_prefix_without_dots() {
        let (full, short) = (super::name(), super::short_name());
        assert!(
            full.starts_with(&short) && !short.contains('.'),
            "{full} {short}"
        );
    }
}
