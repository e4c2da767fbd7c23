//! The backend's queue of work. Ops record their dispatches (and copies through staging
//! buffers) into an open command buffer; it is submitted when the host next needs the
//! device's results or memory (a read-back, a copy into mapped memory, a sync), so a step's
//! ops cost one submission. A graph is a command buffer
//! recorded once and submitted on every replay, without waiting for it.

use std::sync::{Arc, Mutex, MutexGuard};

use ash::vk;
use corral_backend::Result;

use crate::device::DeviceInner;
use crate::kernel::{Kernel, record, record_host_barrier, record_transfer_barrier};
use crate::vk_err;

/// A graph's recording: its own command pool and buffer, freed when the graph drops.
pub(crate) struct Recorded {
    device: Arc<DeviceInner>,
    pool: vk::CommandPool,
    commands: vk::CommandBuffer,
}

impl Drop for Recorded {
    fn drop(&mut self) {
        // SAFETY: a replay that submitted this is waited for before anything else reaches
        // the queue's fence, and the stream waits for its work before the backend drops;
        // a graph dropped while its replay runs would be the model's bug, which the wait
        // below guards against.
        #[allow(unsafe_code)]
        unsafe {
            let _queue = self
                .device
                .queue_lock
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let _ = self.device.device.queue_wait_idle(self.device.queue);
            self.device.device.destroy_command_pool(self.pool, None);
        }
    }
}

/// What the stream holds between calls.
struct State {
    pool: vk::CommandPool,
    /// The eager work recorded since the last submission, if any.
    open: Option<vk::CommandBuffer>,
    /// Submitted command buffers of `pool`, reset once the fence signals.
    pending: Vec<vk::CommandBuffer>,
    /// Command buffers ready to record.
    free: Vec<vk::CommandBuffer>,
    /// The graph being recorded.
    capture: Option<Recorded>,
    /// Signalled when the last submission completes.
    fence: vk::Fence,
    /// A submission the fence has not yet been waited for.
    in_flight: bool,
}

/// One queue's stream of work.
pub(crate) struct Stream {
    device: Arc<DeviceInner>,
    state: Mutex<State>,
}

impl Drop for Stream {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the handles are the stream's; waiting for the device first means nothing
        // submitted from them is still running.
        #[allow(unsafe_code)]
        unsafe {
            let d = &self.device.device;
            let _ = d.device_wait_idle();
            if let Some(capture) = state.capture.take() {
                drop(capture);
            }
            d.destroy_fence(state.fence, None);
            d.destroy_command_pool(state.pool, None);
        }
    }
}

/// A command pool whose buffers can be reset one at a time.
fn command_pool(device: &DeviceInner) -> Result<vk::CommandPool> {
    // SAFETY: the device is live.
    #[allow(unsafe_code)]
    unsafe {
        device.device.create_command_pool(
            &vk::CommandPoolCreateInfo::default()
                .queue_family_index(device.queue_family)
                .flags(vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER),
            None,
        )
    }
    .map_err(|e| vk_err("a command pool", e))
}

/// A command buffer of `pool`, begun for recording.
///
/// # Safety
/// `pool` is `device`'s and used by no other thread meanwhile.
#[allow(unsafe_code)]
unsafe fn begun(device: &ash::Device, pool: vk::CommandPool) -> Result<vk::CommandBuffer> {
    // SAFETY: the caller's contract.
    unsafe {
        let commands = device
            .allocate_command_buffers(
                &vk::CommandBufferAllocateInfo::default()
                    .command_pool(pool)
                    .command_buffer_count(1),
            )
            .map_err(|e| vk_err("a command buffer", e))?[0];
        device
            .begin_command_buffer(commands, &vk::CommandBufferBeginInfo::default())
            .map_err(|e| vk_err("a command buffer", e))?;
        Ok(commands)
    }
}

impl Stream {
    /// A stream on `device`'s compute queue.
    pub(crate) fn new(device: Arc<DeviceInner>) -> Result<Self> {
        let pool = command_pool(&device)?;
        // SAFETY: the device is live; the pool is destroyed if the fence cannot be made.
        #[allow(unsafe_code)]
        let fence = unsafe {
            device
                .device
                .create_fence(&vk::FenceCreateInfo::default(), None)
                .map_err(|e| {
                    device.device.destroy_command_pool(pool, None);
                    vk_err("a fence", e)
                })?
        };
        Ok(Self {
            device,
            state: Mutex::new(State {
                pool,
                open: None,
                pending: Vec::new(),
                free: Vec::new(),
                capture: None,
                fence,
                in_flight: false,
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records one dispatch: into the graph being recorded, else into the open command
    /// buffer (begun now if none is); `timed` as [`record`] takes it.
    pub(crate) fn dispatch(
        &self,
        kernel: &Kernel,
        launch: ([u32; 3], &[u8]),
        timed: Option<(vk::QueryPool, u32)>,
    ) -> Result<()> {
        let mut state = self.lock();
        let commands = match &state.capture {
            Some(capture) => capture.commands,
            None => self.open(&mut state)?,
        };
        record(&self.device.device, commands, kernel, launch, timed);
        Ok(())
    }

    /// Records copies (`copy`, given the device and the command buffer) into the open
    /// command buffer, never into a graph being recorded: they run before any graph
    /// submitted after them, ordered after the work recorded before them and before the
    /// dispatches recorded after them.
    pub(crate) fn transfer(
        &self,
        copy: impl FnOnce(&ash::Device, vk::CommandBuffer),
    ) -> Result<()> {
        let mut state = self.lock();
        let commands = self.open(&mut state)?;
        record_transfer_barrier(&self.device.device, commands);
        copy(&self.device.device, commands);
        Ok(())
    }

    /// The open command buffer, begun now if none is.
    fn open(&self, state: &mut State) -> Result<vk::CommandBuffer> {
        if let Some(open) = state.open {
            return Ok(open);
        }
        let d = &self.device.device;
        let commands = match state.free.pop() {
            Some(c) => {
                // SAFETY: a free buffer was reset after its work completed.
                #[allow(unsafe_code)]
                unsafe {
                    d.begin_command_buffer(c, &vk::CommandBufferBeginInfo::default())
                        .map_err(|e| vk_err("a command buffer", e))?;
                }
                c
            }
            // SAFETY: the pool is used under the state's lock only.
            #[allow(unsafe_code)]
            None => unsafe { begun(d, state.pool)? },
        };
        // Buffers dropped from now on wait for this work (a graph being recorded set this
        // when it began).
        self.device.set_busy(true);
        state.open = Some(commands);
        Ok(commands)
    }

    /// Submits the open work, if any, and waits for everything submitted: afterwards the
    /// host may read and write any buffer. Returns whether it waited for the device.
    pub(crate) fn finish(&self) -> Result<bool> {
        let mut state = self.lock();
        self.submit(&mut state, None)?;
        let waited = self.wait(&mut state)?;
        if state.capture.is_none() {
            self.device.set_busy(false);
        }
        Ok(waited)
    }

    /// Submits the open work and then `graph`'s, without waiting for them.
    pub(crate) fn replay(&self, graph: &Recorded) -> Result<()> {
        let mut state = self.lock();
        self.submit(&mut state, Some(graph.commands))
    }

    /// Starts recording dispatches into a graph of their own.
    pub(crate) fn begin_capture(&self) -> Result<()> {
        let mut state = self.lock();
        if state.capture.is_some() {
            return Err(vk_err("begin_capture", vk::Result::ERROR_UNKNOWN));
        }
        let pool = command_pool(&self.device)?;
        // SAFETY: the new pool is this recording's alone.
        #[allow(unsafe_code)]
        let commands = match unsafe { begun(&self.device.device, pool) } {
            Ok(c) => c,
            Err(e) => {
                // SAFETY: the pool is unused.
                #[allow(unsafe_code)]
                unsafe {
                    self.device.device.destroy_command_pool(pool, None);
                }
                return Err(e);
            }
        };
        self.device.set_busy(true);
        state.capture = Some(Recorded {
            device: Arc::clone(&self.device),
            pool,
            commands,
        });
        Ok(())
    }

    /// Ends the graph begun by [`Stream::begin_capture`]; `None` if none was begun.
    pub(crate) fn end_capture(&self) -> Result<Option<Recorded>> {
        let Some(recorded) = self.lock().capture.take() else {
            return Ok(None);
        };
        record_host_barrier(&self.device.device, recorded.commands);
        // SAFETY: the command buffer is in the recording state.
        #[allow(unsafe_code)]
        unsafe {
            self.device
                .device
                .end_command_buffer(recorded.commands)
                .map_err(|e| vk_err("ending a graph", e))?;
        }
        Ok(Some(recorded))
    }

    /// Submits the open command buffer and `then`, after waiting for the previous
    /// submission (one fence serves them all).
    fn submit(&self, state: &mut State, then: Option<vk::CommandBuffer>) -> Result<()> {
        if state.open.is_none() && then.is_none() {
            return Ok(());
        }
        self.wait(state)?;
        let d = &self.device.device;
        let mut commands = [vk::CommandBuffer::null(); 2];
        let mut count = 0;
        if let Some(open) = state.open.take() {
            record_host_barrier(d, open);
            // SAFETY: the open buffer is in the recording state.
            #[allow(unsafe_code)]
            unsafe {
                d.end_command_buffer(open)
                    .map_err(|e| vk_err("ending a command buffer", e))?;
            }
            state.pending.push(open);
            commands[0] = open;
            count = 1;
        }
        if let Some(graph) = then {
            commands[count] = graph;
            count += 1;
        }
        // SAFETY: the buffers are recorded and none is pending (the fence was waited for).
        #[allow(unsafe_code)]
        unsafe {
            self.device.submit(&commands[..count], state.fence, false)?;
        }
        state.in_flight = true;
        self.device.set_busy(true);
        Ok(())
    }

    /// Waits for the submission in flight, if any, and recycles its command buffers.
    fn wait(&self, state: &mut State) -> Result<bool> {
        if !state.in_flight {
            return Ok(false);
        }
        let d = &self.device.device;
        // SAFETY: the fence is the stream's and was submitted; the buffers reset are done.
        #[allow(unsafe_code)]
        unsafe {
            d.wait_for_fences(&[state.fence], true, u64::MAX)
                .and_then(|()| d.reset_fences(&[state.fence]))
                .map_err(|e| vk_err("waiting for the device", e))?;
            state.in_flight = false;
            for c in state.pending.drain(..) {
                d.reset_command_buffer(c, vk::CommandBufferResetFlags::empty())
                    .map_err(|e| vk_err("resetting a command buffer", e))?;
                state.free.push(c);
            }
        }
        Ok(true)
    }
}
