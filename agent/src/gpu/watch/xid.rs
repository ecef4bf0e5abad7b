//! Which XIDs end a node's part in the job, and what each one means, from NVIDIA's Xid catalogue
//! ("Analyzing Xid Errors with the Xid Catalog", NVIDIA's deployment docs for Ampere and later,
//! which gives every XID a mnemonic, a description and an immediate-action "resolution bucket").
//!
//! A node is unhealthy (exit 204) for the XIDs whose immediate action is a GPU reset or a node
//! reboot: until that happens, every process on the GPU is affected, so restarting the ranks on
//! the same GPU only burns the gang's restart budget. The XIDs the catalogue resolves by
//! restarting the application (13 graphics engine exception, 31 memory page fault, 43 GPU stopped
//! processing, 45 preemptive cleanup, 94 contained ECC error, ...) are counted and logged but
//! leave the node in the gang: the failing rank's own exit is what fails the attempt, and the
//! ordinary restart runs on a GPU that is fine for new work. Two memory XIDs are deliberately not
//! fatal: 94 (NVIDIA's memory error-recovery documentation says that after a contained
//! uncorrectable error the page is offlined and "unaffected applications will continue to run and
//! additional workloads can be launched on this GPU without requiring a GPU reset") and 63 (a row
//! remap or page retirement was *recorded*: the repair succeeded and applies at the next reset,
//! which is why the pre-flight gates on "remap pending" rather than on the XID). The watch reports
//! a pending remap on its own as an event.

/// XIDs that make the node unhealthy: the catalogue's "reset the GPU / reboot the node" set.
/// 48 double-bit ECC error, 64 row-remapper / page-retirement recording failure, 74 NVLink error,
/// 79 GPU has fallen off the bus, 95 uncontained ECC error, 119 GSP RPC timeout, 120 GSP error,
/// 140 unrecovered ECC error.
pub const FATAL: [u64; 8] = [48, 64, 74, 79, 95, 119, 120, 140];

/// Whether `xid` makes the node unhealthy.
pub fn is_fatal(xid: u64) -> bool {
    FATAL.contains(&xid)
}

/// The catalogue's short description of `xid`, for the messages an operator reads; `None` for an
/// XID not listed here (the number is printed alone).
pub fn describe(xid: u64) -> Option<&'static str> {
    Some(match xid {
        // 8 is the catalogue's FIFO idle timeout; 43 is reported when a context stops.
        8 => "GPU stopped processing (FIFO idle timeout)",
        13 => "graphics engine exception",
        31 => "GPU memory page fault",
        32 => "invalid or corrupted push buffer stream",
        43 => "GPU stopped processing",
        45 => "preemptive cleanup, due to previous errors",
        48 => "double-bit ECC error",
        61 => "internal micro-controller breakpoint/warning",
        62 => "internal micro-controller halt",
        63 => "ECC page retirement or row remapping recording event",
        64 => "ECC page retirement or row remapper recording failure",
        68 => "video processor exception",
        69 => "graphics engine class error",
        74 => "NVLink error",
        79 => "GPU has fallen off the bus",
        92 => "high single-bit ECC error rate",
        94 => "contained ECC error",
        95 => "uncontained ECC error",
        109 => "context switch timeout",
        119 => "GSP RPC timeout",
        120 => "GSP error",
        140 => "unrecovered ECC error",
        154 => "GPU recovery action changed",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_class_xids_are_fatal_and_application_ones_are_not() {
        for xid in [48, 64, 74, 79, 95, 119, 120, 140] {
            assert!(is_fatal(xid), "{xid}");
            assert!(describe(xid).is_some(), "{xid} has no description");
        }
        for xid in [13, 31, 43, 45, 63, 94, 92, 109, 154, 999] {
            assert!(!is_fatal(xid), "{xid}");
        }
        assert_eq!(describe(79), Some("GPU has fallen off the bus"));
        assert_eq!(describe(12_345), None);
    }
}
