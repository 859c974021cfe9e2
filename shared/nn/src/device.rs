//! [`open_device`]: the one place any relay process opens a candle device,
//! for the policy networks here (`policy.device`) and for the language
//! models of relay-llm (`llm.device`) alike, so every CUDA device gets the
//! same stream and memory-pool settings, and each GPU is opened once per
//! process (one stream for all of its work).

use std::sync::{Mutex, PoisonError};

use candle_core::Device;
pub use relay_config::hyper::backend::DeviceSpec;

/// A device that cannot be opened, and why (the caller names the config field).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{spec} {reason}")]
pub struct DeviceError {
    pub spec: DeviceSpec,
    pub reason: String,
}

/// Opens the device a config names. A CUDA device gets a stream of its own
/// (`new_cuda_with_stream`), not candle's default per-thread stream: weights
/// are placed on one thread (a blocking task) and used on others, and work
/// queued on different per-thread streams is not ordered, so a forward
/// could read a buffer whose upload had not finished. One stream orders
/// every copy and kernel of the device, whichever thread queues it; so
/// that it is the only one, a GPU is opened once per process and later
/// calls get the same device.
///
/// The device's memory pool keeps what is freed ([`keep_freed_memory`]),
/// and its buffers carry no cudarc events ([`without_event_tracking`]).
pub fn open_device(spec: DeviceSpec) -> Result<Device, DeviceError> {
    match spec {
        DeviceSpec::Cpu => Ok(Device::Cpu),
        DeviceSpec::Cuda(n) => {
            static OPENED: Mutex<Vec<(usize, Device)>> = Mutex::new(Vec::new());
            let mut opened = OPENED.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some((_, device)) = opened.iter().find(|(ordinal, _)| *ordinal == n) {
                return Ok(device.clone());
            }
            let device = Device::new_cuda_with_stream(n).map_err(|e| DeviceError {
                spec,
                reason: format!(
                    "cannot be opened ({}); is the NVIDIA driver installed (nvidia-smi) and is there a GPU {n}?",
                    without_backtrace(e)
                ),
            })?;
            without_event_tracking(&device);
            keep_freed_memory(&device).map_err(|e| DeviceError {
                spec,
                reason: format!("its memory pool cannot be set to keep freed memory ({e})"),
            })?;
            opened.push((n, device.clone()));
            Ok(device)
        }
    }
}

/// The cause alone: the backtrace candle attaches is not the user's concern.
fn without_backtrace(e: candle_core::Error) -> candle_core::Error {
    match e {
        candle_core::Error::WithBacktrace { inner, .. } => *inner,
        e => e,
    }
}

/// Sets the release threshold of the device's default memory pool (the one
/// cudarc's stream-ordered allocations draw from) to "never": by default it
/// is 0, so every synchronisation hands the freed memory back to the driver
/// and the next step's allocations map it again. Kept, it is reused, as
/// PyTorch's caching allocator reuses its blocks.
#[cfg(feature = "cuda")]
fn keep_freed_memory(device: &Device) -> std::result::Result<(), String> {
    use candle_core::cuda_backend::cudarc::driver::{result, sys};
    let Device::Cuda(cuda) = device else {
        return Ok(());
    };
    let stream = cuda.cuda_stream();
    let context = stream.context();
    context.bind_to_thread().map_err(|e| e.to_string())?;
    let mut threshold = u64::MAX;
    // SAFETY: the device comes from an open context, and the attribute's
    // value is a u64, as CUDA documents for the release threshold.
    unsafe {
        let pool =
            result::device::get_default_mem_pool(context.cu_device()).map_err(|e| e.to_string())?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
        .result()
        .map_err(|e| e.to_string())
    }
}

/// Stops cudarc from giving each buffer allocated from now on a read and
/// a write event, recorded at every kernel that takes it and waited on
/// when it is freed. `new_cuda_with_stream` puts the context in cudarc's
/// multi-stream mode, where those events order a buffer's uses across
/// streams; this device's work all goes to its one stream, which orders it
/// already, and the events cost host time for every kernel argument.
/// Called before the device allocates anything.
#[cfg(feature = "cuda")]
fn without_event_tracking(device: &Device) {
    if let Device::Cuda(cuda) = device {
        // SAFETY: cudarc asks that buffers without events not be used on
        // another stream than their own: open_device gives each GPU one
        // device with one stream, and candle queues all of a device's
        // copies and kernels on it.
        unsafe { cuda.disable_event_tracking() }
    }
}

#[cfg(not(feature = "cuda"))]
fn without_event_tracking(_device: &Device) {}

#[cfg(not(feature = "cuda"))]
fn keep_freed_memory(_device: &Device) -> std::result::Result<(), String> {
    Ok(())
}
