//! A fake `libnvidia-ml.so`: exports the NVML C functions muster calls, answering from a JSON
//! fixture named by `MUSTER_FAKE_NVML_FIXTURE`. muster loads it through nvml-wrapper's real
//! `dlopen` path (`MUSTER_NVML_LIBRARY=target/<profile>/libfake_nvml.so`), so CI exercises the
//! same adapter code a GPU node runs: symbol lookup, return-code mapping, struct layouts, field
//! IDs, link iteration.
//!
//! The fixture is read by `nvmlInit_v2`; a missing or malformed fixture makes init fail with
//! `NVML_ERROR_UNKNOWN` and one line on stderr. Handles are the device index plus a constant, cast
//! to a pointer that is never dereferenced (NVML handles are opaque). Every entry point catches
//! panics, because unwinding across `extern "C"` aborts the host process.
//!
//! Only the functions below are exported; nvml-wrapper resolves all ~374 names at load time and
//! reports a missing one only when it is called (`FailedToLoadSymbol`), which is itself a case
//! muster must survive.

// This crate is an FFI boundary and nothing else: every function here is called by C-ABI callers
// and writes through raw out-pointers they own. The workspace-wide `unsafe_code = "deny"` is
// not inherited (no `[lints] workspace = true` in Cargo.toml), and this allow makes that explicit.
#![allow(unsafe_code)]
#![allow(
    non_snake_case,
    clippy::missing_safety_doc,
    clippy::not_unsafe_ptr_arg_deref
)]

pub mod fixture;

use std::ffi::{c_char, c_int, c_uint, c_ulong, c_ulonglong};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlEnableState_t, nvmlEventData_t, nvmlEventSet_t, nvmlFieldValue_t,
    nvmlGpuFabricInfo_t, nvmlMemory_v2_t, nvmlPciInfo_t, nvmlProcessInfo_t, nvmlReturn_t,
    nvmlUtilization_t,
};

use fixture::{Device, Node, Step};

/// The environment variable naming the fixture file.
pub const FIXTURE_ENV: &str = "MUSTER_FAKE_NVML_FIXTURE";

const SUCCESS: nvmlReturn_t = 0;
const ERROR_UNINITIALIZED: nvmlReturn_t = 1;
const ERROR_INVALID_ARGUMENT: nvmlReturn_t = 2;
const ERROR_NOT_SUPPORTED: nvmlReturn_t = 3;
const ERROR_INSUFFICIENT_SIZE: nvmlReturn_t = 7;
const ERROR_TIMEOUT: nvmlReturn_t = 10;
const ERROR_GPU_IS_LOST: nvmlReturn_t = 15;
const ERROR_RESET_REQUIRED: nvmlReturn_t = 16;
const ERROR_UNKNOWN: nvmlReturn_t = 999;

/// Queries a lost GPU still answers (see `with_device`).
const IDENTITY_QUERIES: [&str; 3] = [
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetIndex",
];

/// Handles are `HANDLE_BASE + index`; a small non-null integer no allocator hands out.
const HANDLE_BASE: usize = 0x1000;

/// Field IDs served by `nvmlDeviceGetFieldValues` (values as in nvml.h).
const FI_MEMORY_TEMP: u32 = 82;
const FI_NVLINK_LINK_COUNT: u32 = 91;
const FI_REMAPPED_COR: u32 = 142;
const FI_REMAPPED_UNC: u32 = 143;
const FI_REMAPPED_PENDING: u32 = 144;
const FI_REMAPPED_FAILURE: u32 = 145;
const FI_NVSWITCH_CONNECTED_LINK_COUNT: u32 = 147;
const FI_GET_GPU_RECOVERY_ACTION: u32 = 230;

const VALUE_TYPE_UNSIGNED_INT: u32 = 1;
const VALUE_TYPE_UNSIGNED_LONG_LONG: u32 = 3;

struct State {
    node: Node,
    /// When this process first initialised the library: the clock of the fixture's timeline.
    started: std::time::Instant,
    /// Each device's merged fixture entry, which a timeline `set` merges into.
    raw_devices: Vec<serde_json::Value>,
    /// Timeline steps not yet due, earliest first.
    pending: std::collections::VecDeque<Step>,
    /// XIDs that happened and are not yet delivered: (device, xid).
    xids: std::collections::VecDeque<(usize, u64)>,
    /// Event types each device is registered for (`nvmlDeviceRegisterEvents`).
    registered: std::collections::HashMap<usize, u64>,
    /// When a process list was first read: the clock of `listed_for_s`.
    lists_read_since: Option<std::time::Instant>,
    /// Reads so far, per (device, link, counter name).
    counter_reads: std::collections::HashMap<(usize, u32, String), u64>,
    fabric_reads: Vec<u32>,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

/// Runs `f` on the loaded state; panics become `NVML_ERROR_UNKNOWN`.
fn with_state(f: impl FnOnce(&mut State) -> nvmlReturn_t) -> nvmlReturn_t {
    catch_unwind(AssertUnwindSafe(|| {
        let mut guard = match STATE.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        match guard.as_mut() {
            Some(state) => {
                advance(state);
                f(state)
            }
            None => ERROR_UNINITIALIZED,
        }
    }))
    .unwrap_or(ERROR_UNKNOWN)
}

/// Applies every timeline step that is due: `set` changes the device, `xid` queues an event.
fn advance(state: &mut State) {
    let elapsed = state.started.elapsed().as_secs_f64();
    while state.pending.front().is_some_and(|s| s.at_s <= elapsed) {
        let Some(step) = state.pending.pop_front() else {
            break;
        };
        if let Some(patch) = &step.set {
            match fixture::apply(&state.raw_devices[step.device], patch) {
                Ok((raw, device)) => {
                    state.raw_devices[step.device] = raw;
                    state.node.devices[step.device] = device;
                }
                // Checked when the fixture was loaded; unreachable unless that check changes.
                Err(e) => eprintln!("fake-nvml: {e}"),
            }
        }
        if let Some(xid) = step.xid {
            state.xids.push_back((step.device, xid));
        }
    }
}

/// Resolves a handle and applies the device's failure modes (`lost`, `reset_required`, `fail`)
/// for the calling function `name` before `f` answers.
fn with_device(
    name: &str,
    handle: nvmlDevice_t,
    f: impl FnOnce(&mut State, usize) -> nvmlReturn_t,
) -> nvmlReturn_t {
    with_state(|state| {
        let Some(index) = (handle as usize).checked_sub(HANDLE_BASE) else {
            return ERROR_INVALID_ARGUMENT;
        };
        let Some(device) = state.node.devices.get(index) else {
            return ERROR_INVALID_ARGUMENT;
        };
        if let Some(code) = device.fail.get(name) {
            return *code;
        }
        // Identity is static data the driver read at load time; the fake keeps answering it for
        // a lost GPU so reports can name the GPU (to verify on hardware: see the fixtures README).
        if device.lost && !IDENTITY_QUERIES.contains(&name) {
            return ERROR_GPU_IS_LOST;
        }
        if device.reset_required {
            return ERROR_RESET_REQUIRED;
        }
        f(state, index)
    })
}

/// Copies `s` into a caller buffer of `len` bytes, NUL-terminated, or reports it too small.
unsafe fn write_str(s: &str, buf: *mut c_char, len: c_uint) -> nvmlReturn_t {
    if buf.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    let bytes = s.as_bytes();
    if bytes.len() + 1 > len as usize {
        return ERROR_INSUFFICIENT_SIZE;
    }
    std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), buf, bytes.len());
    *buf.add(bytes.len()) = 0;
    SUCCESS
}

/// Writes `value` through `out` unless it is null.
unsafe fn put<T>(out: *mut T, value: T) -> nvmlReturn_t {
    if out.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    out.write(value);
    SUCCESS
}

fn enable(on: bool) -> nvmlEnableState_t {
    nvmlEnableState_t::from(on)
}

fn fill_pci(bus_id: &str, device_id: u32, subsystem_id: u32) -> nvmlPciInfo_t {
    // SAFETY: nvmlPciInfo_t is plain integers and char arrays; all-zero is a valid value.
    let mut pci: nvmlPciInfo_t = unsafe { std::mem::zeroed() };
    let (domain, bus, dev) = parse_bus_id(bus_id);
    pci.domain = domain;
    pci.bus = bus;
    pci.device = dev;
    pci.pciDeviceId = device_id;
    pci.pciSubSystemId = subsystem_id;
    for (dst, src) in pci.busId.iter_mut().zip(bus_id.bytes().take(31)) {
        *dst = src as c_char;
    }
    // The legacy field holds the short form ("0000:18:00.0").
    let legacy = bus_id.get(4..).unwrap_or(bus_id);
    for (dst, src) in pci.busIdLegacy.iter_mut().zip(legacy.bytes().take(15)) {
        *dst = src as c_char;
    }
    pci
}

/// "00000000:18:00.0" → (domain, bus, device); malformed parts read as 0.
fn parse_bus_id(bus_id: &str) -> (u32, u32, u32) {
    let mut parts = bus_id.split(':');
    let domain = parts
        .next()
        .and_then(|p| u32::from_str_radix(p, 16).ok())
        .unwrap_or(0);
    let bus = parts
        .next()
        .and_then(|p| u32::from_str_radix(p, 16).ok())
        .unwrap_or(0);
    let dev = parts
        .next()
        .and_then(|p| p.split('.').next())
        .and_then(|p| u32::from_str_radix(p, 16).ok())
        .unwrap_or(0);
    (domain, bus, dev)
}

/// The processes device `index` lists now (`listed_for_s` runs from the first list read).
fn listed(state: &State, index: usize) -> impl Iterator<Item = &fixture::Process> {
    let elapsed = state.lists_read_since.map(|t| t.elapsed().as_secs_f64());
    dev(state, index)
        .processes
        .iter()
        .filter(move |p| match (p.listed_for_s, elapsed) {
            (Some(limit), Some(elapsed)) => elapsed < limit,
            _ => true,
        })
}

fn dev(state: &State, index: usize) -> &Device {
    &state.node.devices[index]
}

// ---------------------------------------------------------------------------------------------
// Library lifetime and system queries
// ---------------------------------------------------------------------------------------------

#[no_mangle]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    catch_unwind(|| {
        let Some(path) = std::env::var_os(FIXTURE_ENV) else {
            eprintln!("fake-nvml: {FIXTURE_ENV} is not set");
            return ERROR_UNKNOWN;
        };
        match fixture::load_with_devices(std::path::Path::new(&path)) {
            Ok((node, raw_devices)) => {
                let n = node.devices.len();
                let mut pending: Vec<Step> = node.timeline.clone();
                pending.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
                let mut guard = match STATE.lock() {
                    Ok(g) => g,
                    Err(poisoned) => poisoned.into_inner(),
                };
                // A second init (NVML is reference counted) keeps the state, and with it the
                // counters that have already advanced.
                if guard.is_none() {
                    *guard = Some(State {
                        node,
                        started: std::time::Instant::now(),
                        raw_devices,
                        pending: pending.into(),
                        xids: std::collections::VecDeque::new(),
                        registered: std::collections::HashMap::new(),
                        lists_read_since: None,
                        counter_reads: std::collections::HashMap::new(),
                        fabric_reads: vec![0; n],
                    });
                }
                SUCCESS
            }
            Err(e) => {
                eprintln!("fake-nvml: {e}");
                ERROR_UNKNOWN
            }
        }
    })
    .unwrap_or(ERROR_UNKNOWN)
}

#[no_mangle]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    nvmlInit_v2()
}

#[no_mangle]
pub extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    SUCCESS
}

#[no_mangle]
pub extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    let s: &'static [u8] = match result {
        SUCCESS => b"Success\0",
        ERROR_NOT_SUPPORTED => b"Not Supported\0",
        ERROR_GPU_IS_LOST => b"GPU is lost\0",
        ERROR_RESET_REQUIRED => b"GPU requires reset\0",
        _ => b"Unknown Error (fake-nvml)\0",
    };
    s.as_ptr().cast()
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(buf: *mut c_char, len: c_uint) -> nvmlReturn_t {
    with_state(|s| write_str(&s.node.driver_version, buf, len))
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(buf: *mut c_char, len: c_uint) -> nvmlReturn_t {
    with_state(|s| write_str(&s.node.nvml_version, buf, len))
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(out: *mut c_int) -> nvmlReturn_t {
    with_state(|s| put(out, s.node.cuda_driver_version))
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(out: *mut c_int) -> nvmlReturn_t {
    nvmlSystemGetCudaDriverVersion_v2(out)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(out: *mut c_uint) -> nvmlReturn_t {
    with_state(|s| put(out, s.node.devices.len() as c_uint))
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    out: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    with_state(|s| {
        if index as usize >= s.node.devices.len() {
            return ERROR_INVALID_ARGUMENT;
        }
        put(out, (HANDLE_BASE + index as usize) as nvmlDevice_t)
    })
}

// ---------------------------------------------------------------------------------------------
// Identity
// ---------------------------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    d: nvmlDevice_t,
    buf: *mut c_char,
    len: c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetUUID", d, |s, i| {
        write_str(&dev(s, i).uuid, buf, len)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetName(
    d: nvmlDevice_t,
    buf: *mut c_char,
    len: c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetName", d, |s, i| {
        write_str(&dev(s, i).name, buf, len)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetSerial(
    d: nvmlDevice_t,
    buf: *mut c_char,
    len: c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetSerial", d, |s, i| {
        write_str(&dev(s, i).serial, buf, len)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetVbiosVersion(
    d: nvmlDevice_t,
    buf: *mut c_char,
    len: c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetVbiosVersion", d, |s, i| {
        write_str(&dev(s, i).vbios_version, buf, len)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetIndex(d: nvmlDevice_t, out: *mut c_uint) -> nvmlReturn_t {
    with_device("nvmlDeviceGetIndex", d, |_, i| put(out, i as c_uint))
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(
    d: nvmlDevice_t,
    out: *mut c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetMinorNumber", d, |s, i| {
        put(out, dev(s, i).minor_number)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    d: nvmlDevice_t,
    out: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetPciInfo_v3", d, |s, i| {
        let g = dev(s, i);
        put(
            out,
            fill_pci(&g.pci_bus_id, g.pci_device_id, g.pci_subsystem_id),
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetArchitecture(
    d: nvmlDevice_t,
    out: *mut c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetArchitecture", d, |s, i| {
        put(out, dev(s, i).architecture)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCudaComputeCapability(
    d: nvmlDevice_t,
    major: *mut c_int,
    minor: *mut c_int,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetCudaComputeCapability", d, |s, i| {
        let [a, b] = dev(s, i).compute_capability;
        match put(major, a) {
            SUCCESS => put(minor, b),
            e => e,
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    d: nvmlDevice_t,
    out: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetMemoryInfo_v2", d, |s, i| {
        if out.is_null() {
            return ERROR_INVALID_ARGUMENT;
        }
        let expected = (std::mem::size_of::<nvmlMemory_v2_t>() | (2 << 24)) as c_uint;
        if (*out).version != expected {
            // Real NVML answers a wrong struct version with FUNCTION_NOT_FOUND-ish errors;
            // rejecting it here catches a caller built against another layout.
            return ERROR_INVALID_ARGUMENT;
        }
        let total = dev(s, i).memory_total_bytes;
        let used =
            dev(s, i).memory_used_bytes + listed(s, i).map(|p| p.used_memory_bytes).sum::<u64>();
        (*out).total = total;
        (*out).reserved = 0;
        (*out).used = used.min(total);
        (*out).free = total - used.min(total);
        SUCCESS
    })
}

// ---------------------------------------------------------------------------------------------
// Health state
// ---------------------------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetEccMode(
    d: nvmlDevice_t,
    current: *mut nvmlEnableState_t,
    pending: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetEccMode", d, |s, i| {
        let e = &dev(s, i).ecc;
        match put(current, enable(e.current)) {
            SUCCESS => put(pending, enable(e.pending)),
            err => err,
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetTotalEccErrors(
    d: nvmlDevice_t,
    error_type: c_uint,
    counter_type: c_uint,
    out: *mut c_ulonglong,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetTotalEccErrors", d, |s, i| {
        let e = &dev(s, i).ecc;
        if !e.current {
            return ERROR_NOT_SUPPORTED;
        }
        // errorType: 0 corrected, 1 uncorrected; counterType: 0 volatile, 1 aggregate.
        let v = match (error_type, counter_type) {
            (0, 0) => e.volatile_corrected,
            (1, 0) => e.volatile_uncorrected,
            (0, 1) => e.aggregate_corrected,
            (1, 1) => e.aggregate_uncorrected,
            _ => return ERROR_INVALID_ARGUMENT,
        };
        put(out, v)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetRetiredPagesPendingStatus(
    d: nvmlDevice_t,
    out: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    with_device(
        "nvmlDeviceGetRetiredPagesPendingStatus",
        d,
        |s, i| match &dev(s, i).retired_pages {
            Some(r) => put(out, enable(r.pending)),
            None => ERROR_NOT_SUPPORTED,
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetRetiredPages_v2(
    d: nvmlDevice_t,
    cause: c_uint,
    count: *mut c_uint,
    addresses: *mut c_ulonglong,
    timestamps: *mut c_ulonglong,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetRetiredPages_v2", d, |s, i| {
        let Some(r) = &dev(s, i).retired_pages else {
            return ERROR_NOT_SUPPORTED;
        };
        if count.is_null() {
            return ERROR_INVALID_ARGUMENT;
        }
        let n = if cause == 0 {
            r.single_bit
        } else {
            r.double_bit
        };
        let room = *count;
        *count = n;
        if addresses.is_null() || room < n {
            return if room == 0 && n == 0 {
                SUCCESS
            } else {
                ERROR_INSUFFICIENT_SIZE
            };
        }
        for k in 0..n as usize {
            *addresses.add(k) = 0x1000 * (k as u64 + 1);
            if !timestamps.is_null() {
                *timestamps.add(k) = 1_700_000_000 + k as u64;
            }
        }
        SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetFieldValues(
    d: nvmlDevice_t,
    count: c_int,
    values: *mut nvmlFieldValue_t,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetFieldValues", d, |s, i| {
        if values.is_null() || count < 0 {
            return ERROR_INVALID_ARGUMENT;
        }
        let g = dev(s, i);
        for k in 0..count as usize {
            let fv = &mut *values.add(k);
            fv.timestamp = 1_700_000_000_000_000;
            fv.latencyUsec = 1;
            let (value, ty): (Option<u64>, u32) = match fv.fieldId {
                FI_MEMORY_TEMP => (Some(u64::from(g.temperature_c)), VALUE_TYPE_UNSIGNED_INT),
                FI_NVLINK_LINK_COUNT => (
                    g.nvlink.as_ref().map(|n| u64::from(n.links)),
                    VALUE_TYPE_UNSIGNED_INT,
                ),
                FI_NVSWITCH_CONNECTED_LINK_COUNT => (
                    g.nvlink
                        .as_ref()
                        .filter(|n| n.remote == "switch")
                        .map(|n| u64::from(n.links) - n.down.len() as u64),
                    VALUE_TYPE_UNSIGNED_INT,
                ),
                FI_REMAPPED_COR => (
                    g.remapped_rows.as_ref().map(|r| r.correctable),
                    VALUE_TYPE_UNSIGNED_INT,
                ),
                FI_REMAPPED_UNC => (
                    g.remapped_rows.as_ref().map(|r| r.uncorrectable),
                    VALUE_TYPE_UNSIGNED_INT,
                ),
                FI_REMAPPED_PENDING => (
                    g.remapped_rows.as_ref().map(|r| u64::from(r.pending)),
                    VALUE_TYPE_UNSIGNED_INT,
                ),
                FI_REMAPPED_FAILURE => (
                    g.remapped_rows.as_ref().map(|r| u64::from(r.failure)),
                    VALUE_TYPE_UNSIGNED_INT,
                ),
                FI_GET_GPU_RECOVERY_ACTION => {
                    (g.recovery_action.map(u64::from), VALUE_TYPE_UNSIGNED_INT)
                }
                _ => (None, VALUE_TYPE_UNSIGNED_LONG_LONG),
            };
            match value {
                Some(v) => {
                    fv.nvmlReturn = SUCCESS;
                    fv.valueType = ty;
                    if ty == VALUE_TYPE_UNSIGNED_INT {
                        fv.value.uiVal = v as c_uint;
                    } else {
                        fv.value.ullVal = v;
                    }
                }
                None => fv.nvmlReturn = ERROR_NOT_SUPPORTED,
            }
        }
        SUCCESS
    })
}

/// Bit values of `NVML_CLOCKS_EVENT_REASON_*` (same bits as the older THROTTLE names).
fn throttle_bit(name: &str) -> Option<u64> {
    Some(match name {
        "gpu_idle" => 0x1,
        "applications_clocks_setting" => 0x2,
        "sw_power_cap" => 0x4,
        "hw_slowdown" => 0x8,
        "sync_boost" => 0x10,
        "sw_thermal_slowdown" => 0x20,
        "hw_thermal_slowdown" => 0x40,
        "hw_power_brake_slowdown" => 0x80,
        "display_clock_setting" => 0x100,
        _ => return None,
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCurrentClocksThrottleReasons(
    d: nvmlDevice_t,
    out: *mut c_ulonglong,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetCurrentClocksThrottleReasons", d, |s, i| {
        let mut bits = 0;
        for name in &dev(s, i).throttle_reasons {
            match throttle_bit(name) {
                Some(b) => bits |= b,
                None => {
                    eprintln!("fake-nvml: unknown throttle reason {name:?} in fixture");
                    return ERROR_UNKNOWN;
                }
            }
        }
        put(out, bits)
    })
}

/// `nvmlClockType_t`: only `NVML_CLOCK_SM` (1) is in fixtures.
const CLOCK_SM: c_uint = 1;

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetClockInfo(
    d: nvmlDevice_t,
    clock: c_uint,
    out: *mut c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetClockInfo", d, |s, i| {
        match (&dev(s, i).clocks, clock) {
            (Some(c), CLOCK_SM) => put(out, c.sm_mhz),
            _ => ERROR_NOT_SUPPORTED,
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMaxClockInfo(
    d: nvmlDevice_t,
    clock: c_uint,
    out: *mut c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetMaxClockInfo", d, |s, i| {
        match (&dev(s, i).clocks, clock) {
            (Some(c), CLOCK_SM) => put(out, c.sm_max_mhz),
            _ => ERROR_NOT_SUPPORTED,
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCurrentClocksEventReasons(
    d: nvmlDevice_t,
    out: *mut c_ulonglong,
) -> nvmlReturn_t {
    nvmlDeviceGetCurrentClocksThrottleReasons(d, out)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetTemperature(
    d: nvmlDevice_t,
    sensor: c_uint,
    out: *mut c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetTemperature", d, |s, i| {
        if sensor != 0 {
            return ERROR_INVALID_ARGUMENT;
        }
        put(out, dev(s, i).temperature_c)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetTemperatureThreshold(
    d: nvmlDevice_t,
    threshold: c_uint,
    out: *mut c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetTemperatureThreshold", d, |s, i| {
        let g = dev(s, i);
        // 0 SHUTDOWN, 1 SLOWDOWN; the memory/GPU-max thresholds are not modelled.
        match threshold {
            0 => put(out, g.shutdown_c),
            1 => put(out, g.slowdown_c),
            _ => ERROR_NOT_SUPPORTED,
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    d: nvmlDevice_t,
    out: *mut nvmlUtilization_t,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetUtilizationRates", d, |s, i| {
        let g = dev(s, i);
        put(
            out,
            nvmlUtilization_t {
                gpu: g.utilization_gpu_percent,
                memory: g.utilization_memory_percent,
            },
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPowerUsage(
    d: nvmlDevice_t,
    out: *mut c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetPowerUsage", d, |s, i| {
        put(out, dev(s, i).power.usage_mw)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetEnforcedPowerLimit(
    d: nvmlDevice_t,
    out: *mut c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetEnforcedPowerLimit", d, |s, i| {
        put(out, dev(s, i).power.enforced_limit_mw)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPowerManagementDefaultLimit(
    d: nvmlDevice_t,
    out: *mut c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetPowerManagementDefaultLimit", d, |s, i| {
        put(out, dev(s, i).power.default_limit_mw)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCurrPcieLinkGeneration(
    d: nvmlDevice_t,
    out: *mut c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetCurrPcieLinkGeneration", d, |s, i| {
        put(out, dev(s, i).pcie.cur_gen)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMaxPcieLinkGeneration(
    d: nvmlDevice_t,
    out: *mut c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetMaxPcieLinkGeneration", d, |s, i| {
        put(out, dev(s, i).pcie.max_gen)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCurrPcieLinkWidth(
    d: nvmlDevice_t,
    out: *mut c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetCurrPcieLinkWidth", d, |s, i| {
        put(out, dev(s, i).pcie.cur_width)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMaxPcieLinkWidth(
    d: nvmlDevice_t,
    out: *mut c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetMaxPcieLinkWidth", d, |s, i| {
        put(out, dev(s, i).pcie.max_width)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPcieReplayCounter(
    d: nvmlDevice_t,
    out: *mut c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetPcieReplayCounter", d, |s, i| {
        put(out, dev(s, i).pcie.replay_counter)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPersistenceMode(
    d: nvmlDevice_t,
    out: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetPersistenceMode", d, |s, i| {
        put(out, enable(dev(s, i).persistence_mode))
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    d: nvmlDevice_t,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetMigMode", d, |s, i| {
        let m = &dev(s, i).mig;
        match put(current, c_uint::from(m.current)) {
            SUCCESS => put(pending, c_uint::from(m.pending)),
            e => e,
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    d: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetComputeRunningProcesses_v3", d, |s, i| {
        if count.is_null() {
            return ERROR_INVALID_ARGUMENT;
        }
        s.lists_read_since
            .get_or_insert_with(std::time::Instant::now);
        let procs: Vec<&fixture::Process> = listed(s, i).collect();
        let room = *count as usize;
        *count = procs.len() as c_uint;
        if procs.is_empty() {
            return SUCCESS;
        }
        if infos.is_null() || room < procs.len() {
            return ERROR_INSUFFICIENT_SIZE;
        }
        for (k, p) in procs.iter().enumerate() {
            let slot = &mut *infos.add(k);
            slot.pid = p.pid;
            slot.usedGpuMemory = p.used_memory_bytes;
            slot.gpuInstanceId = u32::MAX;
            slot.computeInstanceId = u32::MAX;
        }
        SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetGpuFabricInfo(
    d: nvmlDevice_t,
    out: *mut nvmlGpuFabricInfo_t,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetGpuFabricInfo", d, |s, i| {
        let reads = s.fabric_reads[i];
        s.fabric_reads[i] = reads.saturating_add(1);
        let Some(f) = &dev(s, i).fabric else {
            return ERROR_NOT_SUPPORTED;
        };
        let state_name = match f.completes_after_reads {
            Some(k) if reads >= k => "completed",
            _ => f.state.as_str(),
        };
        let state = match state_name {
            "not_supported" => 0,
            "not_started" => 1,
            "in_progress" => 2,
            "completed" => 3,
            other => {
                eprintln!("fake-nvml: unknown fabric state {other:?} in fixture");
                return ERROR_UNKNOWN;
            }
        };
        if out.is_null() {
            return ERROR_INVALID_ARGUMENT;
        }
        let mut uuid = [0u8; 16];
        for (dst, src) in uuid.iter_mut().zip(f.cluster_uuid.bytes()) {
            *dst = src;
        }
        (*out).clusterUuid = uuid;
        (*out).status = f.status;
        (*out).cliqueId = f.clique_id;
        (*out).state = state;
        SUCCESS
    })
}

// ---------------------------------------------------------------------------------------------
// NVLink
// ---------------------------------------------------------------------------------------------

/// Runs `f` with the device's NVLink description after checking the link index.
fn with_link(
    name: &str,
    d: nvmlDevice_t,
    link: c_uint,
    f: impl FnOnce(&mut State, usize) -> nvmlReturn_t,
) -> nvmlReturn_t {
    with_device(name, d, |s, i| match &dev(s, i).nvlink {
        None => ERROR_NOT_SUPPORTED,
        Some(n) if link >= n.links => ERROR_INVALID_ARGUMENT,
        Some(_) => f(s, i),
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkState(
    d: nvmlDevice_t,
    link: c_uint,
    out: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    with_link("nvmlDeviceGetNvLinkState", d, link, |s, i| {
        let down = dev(s, i)
            .nvlink
            .as_ref()
            .is_some_and(|n| n.down.contains(&link));
        put(out, enable(!down))
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkVersion(
    d: nvmlDevice_t,
    link: c_uint,
    out: *mut c_uint,
) -> nvmlReturn_t {
    with_link("nvmlDeviceGetNvLinkVersion", d, link, |s, i| {
        put(out, dev(s, i).nvlink.as_ref().map_or(0, |n| n.version))
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo_v2(
    d: nvmlDevice_t,
    link: c_uint,
    out: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    with_link("nvmlDeviceGetNvLinkRemotePciInfo_v2", d, link, |s, i| {
        let Some(n) = dev(s, i).nvlink.as_ref() else {
            return ERROR_NOT_SUPPORTED;
        };
        if n.remote == "gpu" {
            let Some(peer) = n
                .peer_gpus
                .get(link as usize % n.peer_gpus.len().max(1))
                .and_then(|p| s.node.devices.get(*p as usize))
            else {
                return ERROR_NOT_SUPPORTED;
            };
            return put(
                out,
                fill_pci(&peer.pci_bus_id, peer.pci_device_id, peer.pci_subsystem_id),
            );
        }
        match n
            .switch_bus_ids
            .get(link as usize % n.switch_bus_ids.len().max(1))
        {
            // 0x22a3 is the third-generation NVSwitch's PCI device id, vendor 0x10de.
            Some(bus) => put(out, fill_pci(bus, 0x22a3_10de, 0)),
            None => ERROR_NOT_SUPPORTED,
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemoteDeviceType(
    d: nvmlDevice_t,
    link: c_uint,
    out: *mut c_uint,
) -> nvmlReturn_t {
    with_link("nvmlDeviceGetNvLinkRemoteDeviceType", d, link, |s, i| {
        // NVML_NVLINK_DEVICE_TYPE_GPU 0, _SWITCH 2.
        let remote = dev(s, i).nvlink.as_ref().map_or("", |n| n.remote.as_str());
        put(out, if remote == "gpu" { 0 } else { 2 })
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkErrorCounter(
    d: nvmlDevice_t,
    link: c_uint,
    counter: c_uint,
    out: *mut c_ulonglong,
) -> nvmlReturn_t {
    with_link("nvmlDeviceGetNvLinkErrorCounter", d, link, |s, i| {
        let name = match counter {
            0 => "replay",
            1 => "recovery",
            2 => "crc_flit",
            3 => "crc_data",
            _ => return ERROR_NOT_SUPPORTED,
        };
        let spec = dev(s, i).nvlink.as_ref().and_then(|n| {
            n.counters
                .iter()
                .find(|c| c.link == link && c.counter == name)
                .map(|c| (c.start, c.per_read))
        });
        let Some((start, per_read)) = spec else {
            return put(out, 0);
        };
        let reads = s
            .counter_reads
            .entry((i, link, name.to_string()))
            .or_insert(0);
        let value = start + per_read * *reads;
        *reads += 1;
        put(out, value)
    })
}

// ---------------------------------------------------------------------------------------------
// Topology and affinity
// ---------------------------------------------------------------------------------------------

fn other_index(s: &State, d: nvmlDevice_t) -> Option<usize> {
    (d as usize)
        .checked_sub(HANDLE_BASE)
        .filter(|i| *i < s.node.devices.len())
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetP2PStatus(
    d1: nvmlDevice_t,
    d2: nvmlDevice_t,
    caps: c_uint,
    out: *mut c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetP2PStatus", d1, |s, i| {
        let Some(j) = other_index(s, d2) else {
            return ERROR_INVALID_ARGUMENT;
        };
        let (a, b) = (dev(s, i), dev(s, j));
        if b.lost {
            return ERROR_GPU_IS_LOST;
        }
        let blocked =
            a.p2p_not_ok_with.contains(&(j as u32)) || b.p2p_not_ok_with.contains(&(i as u32));
        // NVML_P2P_CAPS_INDEX_NVLINK = 2: only OK when both ends have NVLink.
        let nvlink_ok = a.nvlink.is_some() && b.nvlink.is_some();
        // NVML_P2P_STATUS_OK 0, _NOT_SUPPORTED 5.
        let ok = !blocked && (caps != 2 || nvlink_ok);
        put(out, if ok { 0 } else { 5 })
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetTopologyCommonAncestor(
    d1: nvmlDevice_t,
    d2: nvmlDevice_t,
    out: *mut c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetTopologyCommonAncestor", d1, |s, i| {
        let Some(j) = other_index(s, d2) else {
            return ERROR_INVALID_ARGUMENT;
        };
        let (a, b) = (dev(s, i), dev(s, j));
        // NVML_TOPOLOGY_INTERNAL 0, SINGLE 10, NODE 40, SYSTEM 50.
        let level = if i == j {
            0
        } else if a.pcie_switch == b.pcie_switch {
            10
        } else if a.numa_node == b.numa_node {
            40
        } else {
            50
        };
        put(out, level)
    })
}

/// Writes `bits` (bit numbers) into a caller array of `words` unsigned longs.
unsafe fn write_mask(bits: &[u32], words: c_uint, out: *mut c_ulong) -> nvmlReturn_t {
    if out.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    let per = c_ulong::BITS;
    for w in 0..words as usize {
        *out.add(w) = 0;
    }
    for &b in bits {
        let w = (b / per) as usize;
        if w < words as usize {
            *out.add(w) |= 1 << (b % per);
        }
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCpuAffinity(
    d: nvmlDevice_t,
    words: c_uint,
    out: *mut c_ulong,
) -> nvmlReturn_t {
    with_device(
        "nvmlDeviceGetCpuAffinity",
        d,
        |s, i| match fixture::parse_cpulist(&dev(s, i).cpu_affinity) {
            Ok(cpus) => write_mask(&cpus, words, out),
            Err(e) => {
                eprintln!("fake-nvml: {e}");
                ERROR_UNKNOWN
            }
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCpuAffinityWithinScope(
    d: nvmlDevice_t,
    words: c_uint,
    out: *mut c_ulong,
    _scope: c_uint,
) -> nvmlReturn_t {
    nvmlDeviceGetCpuAffinity(d, words, out)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryAffinity(
    d: nvmlDevice_t,
    words: c_uint,
    out: *mut c_ulong,
    _scope: c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetMemoryAffinity", d, |s, i| {
        write_mask(&[dev(s, i).numa_node], words, out)
    })
}

// ---------------------------------------------------------------------------------------------
// Events: a set's registrations are kept per device; the fixture's timeline XIDs are delivered
// once each, by the first `nvmlEventSetWait_v2` after they are due, to a device registered for
// XID events (real NVML delivers only events that happen after the registration).
// ---------------------------------------------------------------------------------------------

/// `nvmlEventTypeXidCriticalError`.
const EVENT_XID: u64 = 0x8;
/// `nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError | nvmlEventTypeXidCriticalError`.
const SUPPORTED_EVENTS: u64 = 0x1 | 0x2 | EVENT_XID;

#[no_mangle]
pub unsafe extern "C" fn nvmlEventSetCreate(out: *mut nvmlEventSet_t) -> nvmlReturn_t {
    with_state(|_| put(out, HANDLE_BASE as nvmlEventSet_t))
}

#[no_mangle]
pub extern "C" fn nvmlEventSetFree(_set: nvmlEventSet_t) -> nvmlReturn_t {
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    d: nvmlDevice_t,
    out: *mut c_ulonglong,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetSupportedEventTypes", d, |_, _| {
        put(out, SUPPORTED_EVENTS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceRegisterEvents(
    d: nvmlDevice_t,
    types: c_ulonglong,
    _set: nvmlEventSet_t,
) -> nvmlReturn_t {
    with_device("nvmlDeviceRegisterEvents", d, |s, i| {
        if types & !SUPPORTED_EVENTS != 0 {
            return ERROR_NOT_SUPPORTED;
        }
        *s.registered.entry(i).or_insert(0) |= types;
        SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    _set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeout_ms: c_uint,
) -> nvmlReturn_t {
    if data.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    let deadline =
        std::time::Instant::now() + std::time::Duration::from_millis(u64::from(timeout_ms));
    loop {
        // Blocks like real NVML: until an event is due or the timeout passes, sleeping without
        // the state lock so every other call goes on meanwhile.
        let mut next_due: Option<f64> = None;
        let rc = with_state(|s| {
            let deliverable = s.xids.iter().position(|(device, _)| {
                s.registered
                    .get(device)
                    .is_some_and(|types| types & EVENT_XID != 0)
            });
            if let Some((device, xid)) = deliverable.and_then(|k| s.xids.remove(k)) {
                let event = &mut *data;
                event.device = (HANDLE_BASE + device) as nvmlDevice_t;
                event.eventType = EVENT_XID;
                event.eventData = xid;
                event.gpuInstanceId = u32::MAX;
                event.computeInstanceId = u32::MAX;
                return SUCCESS;
            }
            next_due = s
                .pending
                .front()
                .map(|step| step.at_s - s.started.elapsed().as_secs_f64());
            ERROR_TIMEOUT
        });
        if rc != ERROR_TIMEOUT {
            return rc;
        }
        let now = std::time::Instant::now();
        if now >= deadline {
            return ERROR_TIMEOUT;
        }
        let until_due = next_due.map_or(std::time::Duration::MAX, |s| {
            std::time::Duration::from_secs_f64(s.max(0.0))
        });
        std::thread::sleep(
            (deadline - now)
                .min(until_due)
                .max(std::time::Duration::from_millis(1)),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_id_parts() {
        assert_eq!(parse_bus_id("00000000:1A:00.0"), (0, 0x1a, 0));
        assert_eq!(parse_bus_id("garbage"), (0, 0, 0));
    }

    #[test]
    fn masks_and_strings() {
        let mut words = [0 as c_ulong; 2];
        // SAFETY: `words` has room for the 2 words the call writes.
        let rc = unsafe { write_mask(&[0, 3, 65], 2, words.as_mut_ptr()) };
        assert_eq!(rc, SUCCESS);
        assert_eq!(words, [0b1001, 0b10]);
        let mut buf = [0 as c_char; 4];
        // SAFETY: the buffer is 4 bytes and its length is passed.
        assert_eq!(
            unsafe { write_str("abcd", buf.as_mut_ptr(), 4) },
            ERROR_INSUFFICIENT_SIZE
        );
        assert_eq!(unsafe { write_str("abc", buf.as_mut_ptr(), 4) }, SUCCESS);
    }

    #[test]
    fn throttle_names_map_to_nvml_bits() {
        assert_eq!(throttle_bit("hw_slowdown"), Some(0x8));
        assert_eq!(throttle_bit("hw_power_brake_slowdown"), Some(0x80));
        assert_eq!(throttle_bit("nonsense"), None);
    }
}
