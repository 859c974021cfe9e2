//! [`open_device`]: the one place any relay process opens a candle device,
//! for the policy networks here (`policy.device`) and for the language
//! models of relay-llm (`llm.device`) alike, so every CUDA device gets the
//! same stream and memory-pool settings.

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
/// every copy and kernel of the device, whichever thread queues it.
///
/// The device's memory pool keeps what is freed ([`keep_freed_memory`]).
pub fn open_device(spec: DeviceSpec) -> Result<Device, DeviceError> {
    match spec {
        DeviceSpec::Cpu => Ok(Device::Cpu),
        DeviceSpec::Cuda(n) => {
            let device = Device::new_cuda_with_stream(n).map_err(|e| DeviceError {
                spec,
                reason: format!(
                    "cannot be opened ({}); is the NVIDIA driver installed (nvidia-smi) and is there a GPU {n}?",
                    without_backtrace(e)
                ),
            })?;
            keep_freed_memory(&device).map_err(|e| DeviceError {
                spec,
                reason: format!("its memory pool cannot be set to keep freed memory ({e})"),
            })?;
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

#[cfg(not(feature = "cuda"))]
fn keep_freed_memory(_device: &Device) -> std::result::Result<(), String> {
    Ok(())
}
