//! The one NVML query nvml-wrapper 0.13 does not wrap and the pre-flight cannot do without:
//! `nvmlDeviceGetGpuFabricInfo`, the NVSwitch fabric registration state of a Hopper GPU. While
//! the fabric manager is still training routes, `cuInit` fails with "system not yet initialized"
//! (802), so this is what the bounded wait polls.
//!
//! The call goes through nvml-wrapper's own resolved symbol table (`Nvml::lib()`), so it uses the
//! same library, the same `dlopen` and the same initialisation as every other query.

// Calling a raw C function pointer is unsafe by definition; this module holds the project's only
// such call outside the fake NVML. It is a single call with a caller-owned out-struct.
#![allow(unsafe_code)]

use nvml_wrapper::error::{nvml_try, NvmlError};
use nvml_wrapper::{Device, Nvml};

use super::snapshot::{Fabric, FabricState};

/// `nvmlGpuFabricInfo_t` (the v1 struct of nvml.h): cluster UUID, registration status, clique
/// id, state. Mirrored here instead of depending on nvml-wrapper-sys directly; the layout is
/// checked against the size NVML expects in the test below.
#[repr(C)]
struct FabricInfoV1 {
    cluster_uuid: [u8; 16],
    status: u32,
    clique_id: u32,
    state: u8,
}

/// Reads the fabric state of `device`. A library without the symbol (drivers before R525)
/// answers `FailedToLoadSymbol`, which the caller treats as "not supported".
pub fn read(nvml: &Nvml, device: &Device<'_>) -> Result<Fabric, NvmlError> {
    let sym = nvml
        .lib()
        .nvmlDeviceGetGpuFabricInfo
        .as_ref()
        .map_err(|e| NvmlError::FailedToLoadSymbol(e.to_string()))?;
    let mut info = FabricInfoV1 {
        cluster_uuid: [0; 16],
        status: 0,
        clique_id: 0,
        state: 0,
    };
    // SAFETY: `sym` was resolved from the loaded NVML library by nvml-wrapper with this exact C
    // signature; `device.handle()` is a live handle owned by `nvml`, which outlives the call; the
    // out-pointer is a properly aligned, writable struct with nvmlGpuFabricInfo_t's layout.
    let rc = unsafe { sym(device.handle(), std::ptr::addr_of_mut!(info).cast()) };
    nvml_try(rc)?;
    Ok(Fabric {
        state: FabricState::from_raw(info.state),
        status: info.status,
        clique_id: info.clique_id,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn layout_matches_nvml_h() {
        // 16 + 4 + 4 + 1, padded to the 4-byte alignment: what nvml.h's struct occupies.
        assert_eq!(std::mem::size_of::<super::FabricInfoV1>(), 28);
        assert_eq!(std::mem::align_of::<super::FabricInfoV1>(), 4);
    }
}
