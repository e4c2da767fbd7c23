//! Mixture-of-experts: routing and sorting on the device (`moe_route.comp`,
//! `moe_sort.comp`), every expert of a layer in one dispatch per operator, experts' matrices
//! reached through a table of their addresses. Grouped, up to 8 tokens a team of invocations
//! an (expert hit, output) for all its pairs (`moe_*_rows.comp`, `teams.glsl`), more in
//! tiles of each expert's pairs (`moe_*_tiles.comp`); per token, a team a pair's output
//! (`moe_*_per_token.comp`); then the pairs' rows combined (`moe_combine.comp`,
//! `scale_scatter_add.comp`).

use corral_backend::{
    BufferUsage, DType, DeviceBuffer, ExpertMatrices, ExpertWeights, MoeOps, MoeRouting, MoeSorted,
    Result,
};

use super::{grid, grid_of, weight_type};
use crate::VulkanBackend;
use crate::args::{Args, address};

/// Tokens past which the grouped experts run in tiles of each expert's pairs
/// (`moe_*_tiles.comp`), reading each expert's weights once a tile of its pairs; up to
/// them, a team of invocations an (expert hit, output) for all its pairs
/// (`moe_*_rows.comp`): each hit expert read once.
const TILED_FROM_TOKENS: usize = 8;

/// The workgroups of the tiled grouped experts: a slot for each expert that may be hit, a
/// tile of 64 of `outputs`, a tile of 64 of the most pairs one expert can take (one a token).
fn expert_tiles(
    op: &'static str,
    num_experts: usize,
    routing: MoeRouting<'_>,
    outputs: usize,
) -> Result<[u32; 3]> {
    let pairs = routing.tokens * routing.top_k;
    let dims = [
        num_experts.min(pairs),
        outputs.div_ceil(64),
        routing.tokens.div_ceil(64),
    ];
    if dims.iter().any(|&d| d > 65_535) {
        return Err(corral_backend::BackendError::BadArgument {
            op,
            detail: format!("{dims:?} workgroups are past what one dispatch covers"),
        });
    }
    Ok(dims.map(|d| d as u32))
}

impl VulkanBackend {
    /// The address of `m`'s table of its experts' matrix addresses (made once, on first
    /// use, in a buffer no queued work reads yet), and their weight type.
    fn expert_table(&self, op: &'static str, m: &ExpertMatrices) -> Result<(u64, usize)> {
        let dtype = m.dtype().unwrap_or(DType::F32);
        let (table, _) = m.device_table(|m| {
            let words = m
                .locations()
                .into_iter()
                .map(|(b, offset)| Ok(address(op, b)? + dtype.bytes_of(offset) as u64))
                .collect::<Result<Vec<u64>>>()?;
            let mut table =
                self.new_buffer(DType::U32, 2 * words.len().max(1), BufferUsage::Weights)?;
            table.hold_for_graphs();
            self.write_new(op, &table, bytemuck::cast_slice(&words))?;
            Ok((table, false))
        })?;
        Ok((address(op, table)?, weight_type(op, dtype)?))
    }
}

impl MoeOps for VulkanBackend {
    fn moe_route(
        &self,
        logits: &DeviceBuffer,
        tokens: usize,
        num_experts: usize,
        top_k: usize,
        renormalize: bool,
        shared_gate: bool,
        expert_ids: &mut DeviceBuffer,
        expert_weights: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "moe_route";
        let args = Args::new(op)
            .buf(logits)?
            .buf(expert_ids)?
            .buf(expert_weights)?
            .count(tokens)?
            .count(num_experts)?
            .count(top_k)?
            .count(usize::from(renormalize))?
            .count(usize::from(shared_gate))?;
        self.dispatch(op, grid(op, tokens)?, &args)
    }

    fn scale_scatter_add(
        &self,
        y: &DeviceBuffer,
        rows: &DeviceBuffer,
        scales: &DeviceBuffer,
        num_rows: usize,
        dim: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "scale_scatter_add";
        let len = num_rows * dim;
        let args = Args::new(op)
            .buf(y)?
            .buf(rows)?
            .buf(scales)?
            .buf(out)?
            .address(self.fault.address())?
            .count(len)?
            .count(dim)?
            .count(out.len() / dim.max(1))?;
        self.dispatch(op, grid_of(op, len)?, &args)
    }

    fn moe_sort(
        &self,
        routing: MoeRouting<'_>,
        num_experts: usize,
        expert_offsets: &mut DeviceBuffer,
        hit_experts: &mut DeviceBuffer,
        sorted_pairs: &mut DeviceBuffer,
        pair_positions: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "moe_sort";
        let args = Args::new(op)
            .buf(routing.expert_ids)?
            .buf(expert_offsets)?
            .buf(hit_experts)?
            .buf(sorted_pairs)?
            .buf(pair_positions)?
            .address(self.fault.address())?
            .count(routing.tokens * routing.top_k)?
            .count(num_experts)?;
        self.dispatch(op, [1, 1, 1], &args)
    }

    fn moe_grouped_gate_up(
        &self,
        x: &DeviceBuffer,
        routing: MoeRouting<'_>,
        sorted: MoeSorted<'_>,
        experts: &ExpertWeights,
        act: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "moe_grouped_gate_up";
        let (gate, gate_type) = self.expert_table(op, &experts.gate)?;
        let (up, up_type) = self.expert_table(op, &experts.up)?;
        let inter = experts.gate.rows();
        let args = Args::new(op)
            .buf(x)?
            .buf(sorted.expert_offsets)?
            .buf(sorted.hit_experts)?
            .buf(sorted.sorted_pairs)?
            .address(gate)?
            .address(up)?
            .buf(act)?
            .count(routing.top_k)?
            .count(inter)?
            .count(experts.gate.cols())?
            .count(gate_type)?
            .count(up_type)?;
        if routing.tokens <= TILED_FROM_TOKENS {
            let hits = experts
                .gate
                .num_experts()
                .min(routing.tokens * routing.top_k);
            return self.dispatch("moe_gate_up_rows", self.teams(op, hits * inter)?, &args);
        }
        let groups = expert_tiles(op, experts.gate.num_experts(), routing, inter)?;
        self.dispatch("moe_gate_up_tiles", groups, &args)
    }

    fn moe_grouped_down(
        &self,
        act: &DeviceBuffer,
        routing: MoeRouting<'_>,
        sorted: MoeSorted<'_>,
        experts: &ExpertWeights,
        y: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "moe_grouped_down";
        let (down, down_type) = self.expert_table(op, &experts.down)?;
        let pairs = routing.tokens * routing.top_k;
        let hidden = experts.down.rows();
        let args = Args::new(op)
            .buf(act)?
            .buf(routing.expert_weights)?
            .buf(sorted.expert_offsets)?
            .buf(sorted.hit_experts)?
            .buf(sorted.sorted_pairs)?
            .address(down)?
            .buf(y)?
            .count(experts.down.cols())?
            .count(hidden)?
            .count(down_type)?;
        if routing.tokens <= TILED_FROM_TOKENS {
            let hits = experts.down.num_experts().min(pairs);
            return self.dispatch("moe_down_rows", self.teams(op, hits * hidden)?, &args);
        }
        let groups = expert_tiles(op, experts.down.num_experts(), routing, hidden)?;
        self.dispatch("moe_down_tiles", groups, &args)
    }

    fn moe_combine(
        &self,
        y: &DeviceBuffer,
        routing: MoeRouting<'_>,
        sorted: MoeSorted<'_>,
        hidden: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "moe_combine";
        let len = routing.tokens * hidden;
        let args = Args::new(op)
            .buf(y)?
            .buf(sorted.pair_positions)?
            .buf(out)?
            .count(len)?
            .count(routing.top_k)?
            .count(hidden)?;
        self.dispatch(op, grid_of(op, len)?, &args)
    }

    fn moe_experts_per_token(
        &self,
        x: &DeviceBuffer,
        routing: MoeRouting<'_>,
        experts: &ExpertWeights,
        act: &mut DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "moe_experts_per_token";
        let (gate, gate_type) = self.expert_table(op, &experts.gate)?;
        let (up, up_type) = self.expert_table(op, &experts.up)?;
        let pairs = routing.tokens * routing.top_k;
        let inter = experts.gate.rows();
        let args = Args::new(op)
            .buf(x)?
            .buf(routing.expert_ids)?
            .address(gate)?
            .address(up)?
            .buf(act)?
            .address(self.fault.address())?
            .count(pairs)?
            .count(routing.top_k)?
            .count(inter)?
            .count(experts.gate.cols())?
            .count(experts.gate.num_experts())?
            .count(gate_type)?
            .count(up_type)?;
        self.dispatch(
            "moe_gate_up_per_token",
            self.teams(op, pairs * inter)?,
            &args,
        )?;
        let (down, down_type) = self.expert_table(op, &experts.down)?;
        let hidden = experts.down.rows();
        let args = Args::new(op)
            .buf(act)?
            .buf(routing.expert_ids)?
            .buf(routing.expert_weights)?
            .address(down)?
            .buf(out)?
            .address(self.fault.address())?
            .count(routing.tokens)?
            .count(routing.top_k)?
            .count(experts.down.cols())?
            .count(hidden)?
            .count(experts.down.num_experts())?
            .count(down_type)?;
        self.dispatch(
            "moe_down_per_token",
            self.teams(op, routing.tokens * hidden)?,
            &args,
        )
    }
}
