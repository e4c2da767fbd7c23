//! Mixture-of-experts: routing, sorting, the grouped and per-token experts. The CPU backend's
//! entries: the computations in `ops/` on arguments `dyn Backend`'s entries have checked.

use corral_backend::MoeOps;

use crate::*;
impl MoeOps for CpuBackend {
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
        let rows = read_u32(op, rows, num_rows)?;
        let scales = read_f32(op, scales, num_rows)?;
        let y = read_f32(op, y, num_rows * dim)?;
        let available = out.len() / dim.max(1);
        if let Some(&r) = rows.iter().find(|&&r| r as usize >= available) {
            return Err(bad(
                op,
                format!("row {r} is out of range for {available} rows"),
            ));
        }
        let out = write_f32(op, out, available * dim)?;
        self.stats.dispatch(1);
        for (i, &r) in rows.iter().enumerate() {
            let dst = &mut out[r as usize * dim..(r as usize + 1) * dim];
            for (o, v) in dst.iter_mut().zip(&y[i * dim..(i + 1) * dim]) {
                *o += scales[i] * v;
            }
        }
        Ok(())
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
        let pairs = routing.tokens * routing.top_k;
        let ids = read_u32(op, routing.expert_ids, pairs)?;
        if let Some(&e) = ids.iter().find(|&&e| e as usize >= num_experts) {
            return Err(bad(
                op,
                format!("expert {e} is out of range for {num_experts}"),
            ));
        }
        let offsets = write_u32(op, expert_offsets, num_experts + 1)?;
        let hit = write_u32(op, hit_experts, num_experts + 1)?;
        let sorted = write_u32(op, sorted_pairs, pairs)?;
        let positions = write_u32(op, pair_positions, pairs)?;
        self.stats.dispatch(1);
        ops::moe::sort_by_expert(ids, offsets, sorted, positions);
        ops::moe::list_hit_experts(offsets, hit);
        Ok(())
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
        let (hidden, inter) = (experts.gate.cols(), experts.gate.rows());
        let pairs = routing.tokens * routing.top_k;
        let (offsets, order) = checked_sorting(op, sorted, experts.gate.num_experts(), pairs)?;
        let x = read_f32(op, x, routing.tokens * hidden)?;
        let act = write_f32(op, act, pairs * inter)?;
        let gate = ops::moe::ExpertProj::new(op, &experts.gate)?;
        let up = ops::moe::ExpertProj::new(op, &experts.up)?;
        self.stats.dispatch(1);
        let hit = ops::moe::experts_hit(offsets);
        self.stats
            .weight_read(hit * (experts.gate.expert_bytes() + experts.up.expert_bytes()));
        ops::moe::grouped_gate_up(
            x,
            hidden,
            routing.top_k,
            offsets,
            order,
            &gate,
            &up,
            inter,
            act,
        );
        Ok(())
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
        let (hidden, inter) = (experts.down.rows(), experts.down.cols());
        let pairs = routing.tokens * routing.top_k;
        let (offsets, order) = checked_sorting(op, sorted, experts.down.num_experts(), pairs)?;
        let act = read_f32(op, act, pairs * inter)?;
        let weights = read_f32(op, routing.expert_weights, pairs)?;
        let y = write_f32(op, y, pairs * hidden)?;
        let down = ops::moe::ExpertProj::new(op, &experts.down)?;
        self.stats.dispatch(1);
        let hit = ops::moe::experts_hit(offsets);
        self.stats.weight_read(hit * experts.down.expert_bytes());
        ops::moe::grouped_down(act, inter, weights, offsets, order, &down, hidden, y);
        Ok(())
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
        let pairs = routing.tokens * routing.top_k;
        let positions = read_u32(op, sorted.pair_positions, pairs)?;
        if let Some(&s) = positions.iter().find(|&&s| s as usize >= pairs) {
            return Err(bad(
                op,
                format!("position {s} is out of range for {pairs} pairs"),
            ));
        }
        let y = read_f32(op, y, pairs * hidden)?;
        let out = write_f32(op, out, routing.tokens * hidden)?;
        self.stats.dispatch(1);
        ops::moe::combine(y, positions, routing.top_k, hidden, out);
        Ok(())
    }

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
        let (row, choices) = (
            num_experts + shared_gate as usize,
            top_k + shared_gate as usize,
        );
        let logits = read_f32(op, logits, tokens * row)?;
        let ids = write_u32(op, expert_ids, tokens * choices)?;
        let weights = write_f32(op, expert_weights, tokens * choices)?;
        self.stats.dispatch(1);
        ops::moe::route(
            &logits[..tokens * row],
            num_experts,
            top_k,
            renormalize,
            shared_gate,
            &mut ids[..tokens * choices],
            &mut weights[..tokens * choices],
        );
        Ok(())
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
        let MoeRouting { tokens, top_k, .. } = routing;
        let hidden = experts.gate.cols();
        let inter = experts.gate.rows();
        let num_experts = experts.gate.num_experts();
        let ids = read_u32(op, routing.expert_ids, tokens * top_k)?;
        if let Some(&e) = ids.iter().find(|&&e| e as usize >= num_experts) {
            return Err(bad(
                op,
                format!("expert {e} is out of range for {num_experts}"),
            ));
        }
        let weights = read_f32(op, routing.expert_weights, tokens * top_k)?;
        let x = read_f32(op, x, tokens * hidden)?;
        let gate = ops::moe::ExpertProj::new(op, &experts.gate)?;
        let up = ops::moe::ExpertProj::new(op, &experts.up)?;
        let down = ops::moe::ExpertProj::new(op, &experts.down)?;
        let per_pair =
            experts.gate.expert_bytes() + experts.up.expert_bytes() + experts.down.expert_bytes();
        let act = write_f32(op, act, tokens * top_k * inter)?;
        self.stats.dispatch(1);
        self.stats.weight_read(tokens * top_k * per_pair);
        ops::moe::gate_up(x, hidden, ids, top_k, &gate, &up, inter, act);
        let out = write_f32(op, out, tokens * hidden)?;
        self.stats.dispatch(1);
        ops::moe::down_combine(act, inter, ids, weights, top_k, &down, hidden, out);
        Ok(())
    }
}
