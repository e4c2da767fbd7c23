//! Expert weight matrices in one canonical form, whatever the checkpoint layout.
//!
//! Checkpoints store experts either fused (`gate_up_proj` `[E, 2I, H]`, `down_proj` `[E, H, I]`)
//! or one tensor per expert and projection. Both become an [`ExpertMatrices`] per projection,
//! which yields expert `e`'s `[rows, cols]` matrix as a [`WeightView`] without copying.

use std::sync::{Arc, OnceLock};

use crate::{BackendError, DeviceBuffer, Result, WeightView};

#[derive(Debug)]
enum ExpertStorage {
    /// Matrix `e` starts at `offset + e * expert_stride` elements of one buffer.
    Stacked {
        buffer: Arc<DeviceBuffer>,
        offset: usize,
        expert_stride: usize,
    },
    /// One buffer per expert.
    PerExpert(Vec<DeviceBuffer>),
}

/// One projection (`gate`, `up` or `down`) of every expert of a layer, each `[rows, cols]`.
#[derive(Debug)]
pub struct ExpertMatrices {
    storage: ExpertStorage,
    /// One more expert after those of `storage` (a shared expert folded in), `[rows, cols]`.
    extra: Option<DeviceBuffer>,
    num_experts: usize,
    rows: usize,
    cols: usize,
    /// A device backend's per-expert pointer table, made on first use (warm-up).
    device_table: OnceLock<(DeviceBuffer, bool)>,
}

impl ExpertMatrices {
    /// Rows `row_start..row_start + rows` of each `[stacked_rows, cols]` matrix in a stacked
    /// `[num_experts, stacked_rows, cols]` buffer (the gate or up half of a fused tensor).
    pub fn stacked(
        buffer: Arc<DeviceBuffer>,
        num_experts: usize,
        stacked_rows: usize,
        row_start: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Self> {
        whole_rows(buffer.dtype(), cols)?;
        let needed = num_experts * stacked_rows * cols;
        if buffer.len() < needed || row_start + rows > stacked_rows {
            return Err(BackendError::TooSmall {
                op: "expert matrices",
                what: "stacked experts",
                len: buffer.len(),
                needed,
            });
        }
        Ok(Self {
            storage: ExpertStorage::Stacked {
                buffer,
                offset: row_start * cols,
                expert_stride: stacked_rows * cols,
            },
            extra: None,
            num_experts,
            rows,
            cols,
            device_table: OnceLock::new(),
        })
    }

    /// One `[rows, cols]` buffer per expert, all of one type.
    pub fn per_expert(buffers: Vec<DeviceBuffer>, rows: usize, cols: usize) -> Result<Self> {
        if let Some(first) = buffers.first() {
            whole_rows(first.dtype(), cols)?;
            if let Some(other) = buffers.iter().find(|b| b.dtype() != first.dtype()) {
                return Err(BackendError::BadArgument {
                    op: "expert matrices",
                    detail: format!(
                        "experts stored as {} beside experts stored as {}",
                        other.dtype(),
                        first.dtype()
                    ),
                });
            }
        }
        if let Some(short) = buffers.iter().find(|b| b.len() < rows * cols) {
            return Err(BackendError::TooSmall {
                op: "expert matrices",
                what: "per-expert weight",
                len: short.len(),
                needed: rows * cols,
            });
        }
        Ok(Self {
            num_experts: buffers.len(),
            storage: ExpertStorage::PerExpert(buffers),
            extra: None,
            rows,
            cols,
            device_table: OnceLock::new(),
        })
    }

    /// These experts and one more, `matrix` (`[rows, cols]`, stored like the others), as
    /// expert `num_experts()`: a shared expert that every token is routed to, run by the
    /// same grouped and per-token ops as the routed ones.
    pub fn with_extra(mut self, matrix: DeviceBuffer) -> Result<Self> {
        if matrix.len() < self.rows * self.cols {
            return Err(BackendError::TooSmall {
                op: "expert matrices",
                what: "extra expert",
                len: matrix.len(),
                needed: self.rows * self.cols,
            });
        }
        if self.extra.is_some() || self.dtype().is_some_and(|d| d != matrix.dtype()) {
            return Err(BackendError::BadArgument {
                op: "expert matrices",
                detail: format!(
                    "an extra expert stored as {} beside experts stored as {:?}, or a second one",
                    matrix.dtype(),
                    self.dtype()
                ),
            });
        }
        self.extra = Some(matrix);
        self.num_experts += 1;
        Ok(self)
    }

    /// Number of experts.
    pub fn num_experts(&self) -> usize {
        self.num_experts
    }

    /// Rows of each expert's matrix (output features).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns of each expert's matrix (input features).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Expert `expert`'s matrix. Panics if `expert >= num_experts()`: expert ids come from the
    /// router, which never yields one out of range.
    pub fn view(&self, expert: usize) -> WeightView<'_> {
        assert!(expert < self.num_experts, "expert id out of range");
        if let Some(extra) = &self.extra
            && expert + 1 == self.num_experts
        {
            return WeightView {
                buffer: extra,
                offset: 0,
                rows: self.rows,
                cols: self.cols,
            };
        }
        match &self.storage {
            ExpertStorage::Stacked {
                buffer,
                offset,
                expert_stride,
            } => WeightView {
                buffer,
                offset: offset + expert * expert_stride,
                rows: self.rows,
                cols: self.cols,
            },
            ExpertStorage::PerExpert(buffers) => WeightView {
                buffer: &buffers[expert],
                offset: 0,
                rows: self.rows,
                cols: self.cols,
            },
        }
    }

    /// Element type of the matrices (every expert has the same; `None` without experts).
    pub fn dtype(&self) -> Option<crate::DType> {
        match &self.storage {
            ExpertStorage::Stacked { buffer, .. } => Some(buffer.dtype()),
            ExpertStorage::PerExpert(buffers) => buffers.first().map(DeviceBuffer::dtype),
        }
    }

    /// Each expert's buffer and the element where its matrix starts.
    pub fn locations(&self) -> Vec<(&DeviceBuffer, usize)> {
        (0..self.num_experts)
            .map(|e| {
                let view = self.view(e);
                (view.buffer, view.offset)
            })
            .collect()
    }

    /// The device pointer table and whether every matrix allows 16-byte loads, made by
    /// `make` on first use.
    pub fn device_table(
        &self,
        make: impl FnOnce(&Self) -> crate::Result<(DeviceBuffer, bool)>,
    ) -> crate::Result<&(DeviceBuffer, bool)> {
        if let Some(table) = self.device_table.get() {
            return Ok(table);
        }
        let table = make(self)?;
        Ok(self.device_table.get_or_init(|| table))
    }

    /// Bytes of one expert's matrix in storage.
    pub fn expert_bytes(&self) -> usize {
        let dtype = match &self.storage {
            ExpertStorage::Stacked { buffer, .. } => buffer.dtype(),
            ExpertStorage::PerExpert(buffers) => match buffers.first() {
                Some(b) => b.dtype(),
                None => return 0,
            },
        };
        dtype.bytes_of(self.rows * self.cols)
    }
}

/// Checks that rows of `cols` values of `dtype` are whole blocks of its format, so that
/// every expert's matrix starts and ends on one.
fn whole_rows(dtype: crate::DType, cols: usize) -> Result<()> {
    let block = dtype.block_values();
    if cols.is_multiple_of(block) {
        return Ok(());
    }
    Err(BackendError::BadArgument {
        op: "expert matrices",
        detail: format!("{dtype} rows of {cols} values: not whole blocks of {block}"),
    })
}

/// The three projections of every routed expert of one MoE layer.
#[derive(Debug)]
pub struct ExpertWeights {
    /// `[E, I, H]`: gate projection.
    pub gate: ExpertMatrices,
    /// `[E, I, H]`: up projection.
    pub up: ExpertMatrices,
    /// `[E, H, I]`: down projection.
    pub down: ExpertMatrices,
}
