//! Device time per kernel, from timestamps written around each dispatch while profiling is
//! on (`corral bench ... --profile`).

use std::sync::Arc;

use ash::vk;
use corral_backend::{KernelTime, Result};

use crate::device::DeviceInner;
use crate::vk_err;

/// Dispatches timed at most between two reads of the profile.
const MAX_TIMED: u32 = 8192;

/// A timestamp query pool and the kernel each pair of its queries timed; the pool is freed
/// when it drops (after the backend's stream, which waits for the device).
pub(crate) struct Profiler {
    device: Arc<DeviceInner>,
    pool: vk::QueryPool,
    names: Vec<&'static str>,
    /// Nanoseconds a timestamp tick.
    period: f64,
}

impl Profiler {
    /// A profiler on `device`, whose timestamps tick every `period` nanoseconds.
    pub(crate) fn new(device: &Arc<DeviceInner>, period: f32) -> Result<Self> {
        // SAFETY: the device is live; the pool is destroyed when the profiler drops.
        #[allow(unsafe_code)]
        let pool = unsafe {
            device.device.create_query_pool(
                &vk::QueryPoolCreateInfo::default()
                    .query_type(vk::QueryType::TIMESTAMP)
                    .query_count(2 * MAX_TIMED),
                None,
            )
        }
        .map_err(|e| vk_err("a timestamp query pool", e))?;
        Ok(Self {
            device: Arc::clone(device),
            pool,
            names: Vec::new(),
            period: f64::from(period),
        })
    }

    /// The query pair for the next dispatch of `name`, if any is left.
    pub(crate) fn next(&mut self, name: &'static str) -> Option<(vk::QueryPool, u32)> {
        let at = u32::try_from(self.names.len()).ok()?;
        if at >= MAX_TIMED {
            return None;
        }
        self.names.push(name);
        Some((self.pool, 2 * at))
    }

    /// The time of every dispatch timed since the last read, summed by kernel, longest
    /// first; the queries are free again afterwards. The device's work must be done.
    pub(crate) fn read(&mut self) -> Result<Vec<KernelTime>> {
        let names = std::mem::take(&mut self.names);
        if names.is_empty() {
            return Ok(Vec::new());
        }
        let mut ticks = vec![0u64; 2 * names.len()];
        // SAFETY: the queries were written by completed work.
        #[allow(unsafe_code)]
        unsafe {
            self.device.device.get_query_pool_results(
                self.pool,
                0,
                &mut ticks,
                vk::QueryResultFlags::TYPE_64 | vk::QueryResultFlags::WAIT,
            )
        }
        .map_err(|e| vk_err("reading timestamps", e))?;
        let mut times: Vec<KernelTime> = Vec::new();
        for (name, pair) in names.into_iter().zip(ticks.chunks_exact(2)) {
            let ms = pair[1].saturating_sub(pair[0]) as f64 * self.period / 1e6;
            match times.iter_mut().find(|t| t.name == name) {
                Some(t) => {
                    t.launches += 1;
                    t.ms += ms;
                }
                None => times.push(KernelTime {
                    name,
                    launches: 1,
                    ms,
                }),
            }
        }
        times.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        Ok(times)
    }
}

impl Drop for Profiler {
    fn drop(&mut self) {
        // SAFETY: no queued work writes the pool: the backend's stream, dropped first, waits
        // for the device.
        #[allow(unsafe_code)]
        unsafe {
            self.device.device.destroy_query_pool(self.pool, None);
        }
    }
}
