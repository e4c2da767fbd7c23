//! The ops a backend computes, and the argument types they share.

use crate::{BackendError, DType, DeviceBuffer, ExpertWeights, Result, RopeParams, WeightView};

/// Where each token of a ragged batch reads and writes the paged KV cache.
#[derive(Clone, Copy, Debug)]
pub struct AttentionMeta<'a> {
    /// U32 `[tokens]`: absolute position of each token in its sequence.
    pub positions: &'a DeviceBuffer,
    /// U32 `[tokens]`: the run (sequence) each token belongs to.
    pub token_runs: &'a DeviceBuffer,
    /// U32 `[runs, max_blocks_per_run]`: each run's block table, padded.
    pub block_tables: &'a DeviceBuffer,
    /// U32 `[tokens]`: cache slot (`block * block_size + offset`) each token's K and V go to.
    pub slots: &'a DeviceBuffer,
    /// Columns of `block_tables`.
    pub max_blocks_per_run: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Tokens in the batch.
    pub tokens: usize,
    /// Tokens of the longest run (1 for a batch of decode rows): chooses kernels, and 1
    /// promises that only each token's own key is stored in this step.
    pub max_run_tokens: usize,
    /// Tokens at the batch's start that are runs of one token each (decode rows ahead of
    /// the prefill runs): a GPU gives them its decode kernel, split over their keys.
    pub leading_decode_tokens: usize,
}

/// Shapes of [`Ops::qkv_norm_rope_store`].
#[derive(Clone, Copy, Debug)]
pub struct QkShape {
    /// Tokens in the batch.
    pub tokens: usize,
    /// Query heads.
    pub heads: usize,
    /// Key heads.
    pub kv_heads: usize,
    /// Dimension of each head.
    pub head_dim: usize,
    /// Leading dims of each head that RoPE rotates.
    pub rotary_dim: usize,
    /// RoPE's base and scaling.
    pub rope: RopeParams,
    /// RMSNorm epsilon.
    pub eps: f32,
}

/// Head layout of an attention layer.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads; query head `h` reads KV head `h / (num_heads / num_kv_heads)`.
    pub num_kv_heads: usize,
    /// Dimension of each head.
    pub head_dim: usize,
    /// Multiplier on `q·k`, usually `head_dim^-1/2`.
    pub scale: f32,
}

/// Routing of each token to its top-k experts, as produced by [`Ops::moe_route`].
#[derive(Clone, Copy, Debug)]
pub struct MoeRouting<'a> {
    /// U32 `[tokens, top_k]`: selected expert ids.
    pub expert_ids: &'a DeviceBuffer,
    /// F32 `[tokens, top_k]`: their weights.
    pub expert_weights: &'a DeviceBuffer,
    /// Tokens routed.
    pub tokens: usize,
    /// Experts per token.
    pub top_k: usize,
}

/// Routed pairs sorted by expert, as produced by [`Ops::moe_sort`]. A pair `p = t * top_k
/// + j` is token `t`'s `j`-th expert choice.
#[derive(Clone, Copy, Debug)]
pub struct MoeSorted<'a> {
    /// U32 `[num_experts + 1]`: expert `e`'s pairs sit at sorted positions
    /// `offsets[e]..offsets[e + 1]`.
    pub expert_offsets: &'a DeviceBuffer,
    /// U32 `[num_experts + 1]`: how many experts have pairs, then their ids in ascending
    /// order (so that a device kernel finds its expert in one read, not a scan).
    pub hit_experts: &'a DeviceBuffer,
    /// U32 `[pairs]`: the pair at each sorted position.
    pub sorted_pairs: &'a DeviceBuffer,
    /// U32 `[pairs]`: the sorted position of each pair.
    pub pair_positions: &'a DeviceBuffer,
}

/// Where each run of a ragged batch keeps its recurrent state (linear-attention layers).
#[derive(Clone, Copy, Debug)]
pub struct RecurrentRuns<'a> {
    /// U32 `[runs, 4]`: first token in the batch, token count, state slot, and 1 when the
    /// sequence starts here (its state is taken as zero), else 0.
    pub runs: &'a DeviceBuffer,
    /// Runs in the batch.
    pub num_runs: usize,
    /// No run is longer (a promise: a backend may pick its kernels by it, e.g. the
    /// recurrence for single tokens and the chunked form for prefill).
    pub max_run_tokens: usize,
    /// U32 `[runs]`, where given: per run, the first of `len - 1` consecutive state slots
    /// that take its state after each of its tokens but the last ([`NO_KEPT_STATES`]: none),
    /// so that a speculative verify can continue from any accepted draft position.
    pub kept: Option<&'a DeviceBuffer>,
}

/// [`RecurrentRuns::kept`]'s entry for a run whose intermediate states are not kept.
pub const NO_KEPT_STATES: u32 = u32::MAX;

/// Head layout of a Gated DeltaNet layer.
#[derive(Clone, Copy, Debug)]
pub struct DeltaNetShape {
    /// Key (and query) heads.
    pub num_key_heads: usize,
    /// Value heads; value head `j` reads key head `j / (num_value_heads / num_key_heads)`.
    pub num_value_heads: usize,
    /// Key head dimension.
    pub key_dim: usize,
    /// Value head dimension.
    pub value_dim: usize,
}

/// The op table a backend computes, one trait a family of ops. Every model family is
/// written against it; a backend implements each op as one dispatch (or says in the
/// op's doc how many it takes). Outputs are passed in, never returned, so ops allocate
/// nothing. The model calls the ops through `dyn Backend`'s entry points of the same
/// names, which check their arguments first.
pub trait Ops:
    CopyOps + NormOps + MatmulOps + AttentionOps + MoeOps + RecurrentOps + SamplingOps + Send + Sync
{
}

impl<T> Ops for T where
    T: CopyOps
        + NormOps
        + MatmulOps
        + AttentionOps
        + MoeOps
        + RecurrentOps
        + SamplingOps
        + Send
        + Sync
{
}

/// Copies: zeroing, gathers, the embedding lookup, KV blocks.
pub trait CopyOps {
    /// Sets the first `len` elements of an F32 buffer to zero.
    fn fill_zero(&self, buffer: &mut DeviceBuffer, len: usize) -> Result<()>;

    /// `out[t] = table[ids[t]]` for `tokens` ids; table rows are `hidden` wide. F32 out.
    fn embedding(
        &self,
        table: WeightView<'_>,
        ids: &DeviceBuffer,
        tokens: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()>;

    /// Copies `rows[i]` of `x` (rows `dim` wide) to row `i` of `out`, for `rows.len()` rows.
    fn gather_rows(
        &self,
        x: &DeviceBuffer,
        row_ids: &DeviceBuffer,
        num_rows: usize,
        dim: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()>;

    /// Copies block `ids[i]` of `paged` (blocks of `block_elems` elements, any stored type)
    /// to block `i` of `packed` (the same type), for `count` blocks: a session's KV blocks
    /// gathered on the device so that they cross to the host in one copy.
    fn gather_blocks(
        &self,
        paged: &DeviceBuffer,
        ids: &DeviceBuffer,
        count: usize,
        block_elems: usize,
        packed: &mut DeviceBuffer,
    ) -> Result<()>;

    /// Copies block `i` of `packed` to block `ids[i]` of `paged`, for `count` blocks: the
    /// inverse of [`Ops::gather_blocks`], a session's KV read back.
    fn scatter_blocks(
        &self,
        packed: &DeviceBuffer,
        ids: &DeviceBuffer,
        count: usize,
        block_elems: usize,
        paged: &mut DeviceBuffer,
    ) -> Result<()>;

    /// Copies elements `src .. src + len` of the buffer `x` (any stored type) to
    /// `dst .. dst + len`, ranges that do not overlap, on the device: one recurrent-state slot
    /// into another for checkpoints, one KV block into another for copy-on-write.
    fn copy_within(&self, x: &mut DeviceBuffer, src: usize, dst: usize, len: usize) -> Result<()>;
}

/// Norms and elementwise ops.
pub trait NormOps {
    /// RMSNorm over each of `rows` rows of `dim`: `out = x / sqrt(mean(x²) + eps) * w`, where
    /// `w = weight` or, with `offset_one`, `w = 1 + weight` (zero-centred norms); `out` in F32
    /// or in [`Device::gemm_input_dtype`](crate::Device::gemm_input_dtype)'s type.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm(
        &self,
        x: &DeviceBuffer,
        weight: &DeviceBuffer,
        rows: usize,
        dim: usize,
        eps: f32,
        offset_one: bool,
        out: &mut DeviceBuffer,
    ) -> Result<()>;

    /// `acc[i] += x[i]` for the first `len` elements.
    fn add_in_place(&self, acc: &mut DeviceBuffer, x: &DeviceBuffer, len: usize) -> Result<()>;

    /// The residual add and the next RMSNorm: `acc += x`, then `out = rms_norm(acc)` over
    /// `rows` rows of `dim` (as [`Ops::rms_norm`]). One dispatch where the backend fuses
    /// them; by default the two ops.
    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm(
        &self,
        acc: &mut DeviceBuffer,
        x: &DeviceBuffer,
        weight: &DeviceBuffer,
        rows: usize,
        dim: usize,
        eps: f32,
        offset_one: bool,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        self.add_in_place(acc, x, rows * dim)?;
        self.rms_norm(acc, weight, rows, dim, eps, offset_one, out)
    }

    /// `out[i] = silu(gate[i]) * up[i]` for the first `len` elements.
    fn silu_mul(
        &self,
        gate: &DeviceBuffer,
        up: &DeviceBuffer,
        len: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()>;

    /// `out[i] = x[i] · σ(gate[i])` for the first `len` elements (gated attention output).
    fn sigmoid_mul(
        &self,
        x: &DeviceBuffer,
        gate: &DeviceBuffer,
        len: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()>;

    /// `acc[t] += σ(gate[t]) · x[t]` for `rows` rows of `dim` (the shared expert, scaled by its
    /// per-token gate).
    fn add_sigmoid_gated(
        &self,
        acc: &mut DeviceBuffer,
        x: &DeviceBuffer,
        gate: &DeviceBuffer,
        rows: usize,
        dim: usize,
    ) -> Result<()>;

    /// Gated RMSNorm per row of `dim`: `out = (w ⊙ rmsnorm(x)) ⊙ silu(z)` (plain weight).
    #[allow(clippy::too_many_arguments)]
    fn gated_rms_norm(
        &self,
        x: &DeviceBuffer,
        z: &DeviceBuffer,
        weight: &DeviceBuffer,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut DeviceBuffer,
    ) -> Result<()>;
}

/// Projections.
pub trait MatmulOps {
    /// `out[rows, w.rows] = x[rows, w.cols] · wᵀ`; weights in any float type, F32 out; x in
    /// F32, or in the type [`Device::gemm_input_dtype`](crate::Device::gemm_input_dtype) names.
    fn matmul(
        &self,
        x: &DeviceBuffer,
        rows: usize,
        w: WeightView<'_>,
        out: &mut DeviceBuffer,
    ) -> Result<()>;

    /// `x · wᵀ` for each of a projection's `parts` stored apart (each a matrix of `cols` columns
    /// and its rows), side by side from column 0 of `out`'s `rows` rows of `out_cols`: what
    /// [`Self::matmul_columns`] gives part by part. A backend may share work between the
    /// parts (the GPU quantizes x once for them).
    fn matmul_parts(
        &self,
        x: &DeviceBuffer,
        rows: usize,
        (parts, cols): (&[(DeviceBuffer, usize)], usize),
        out: &mut DeviceBuffer,
        out_cols: usize,
    ) -> Result<()> {
        matmul_parts_by_columns(self, x, rows, (parts, cols), out, out_cols)
    }

    /// `x · wᵀ` into columns `col0..col0 + w.rows` of `out`'s `rows` rows of `out_cols`: one
    /// part of a projection whose parts are stored apart (a GGUF file's q, k and v in
    /// different block formats), written where the stacked projection would write it.
    fn matmul_columns(
        &self,
        x: &DeviceBuffer,
        rows: usize,
        w: WeightView<'_>,
        out: &mut DeviceBuffer,
        out_cols: usize,
        col0: usize,
    ) -> Result<()>;

    /// Several projections of one input: `outs[i] = x · weights[i]ᵀ`, as [`Ops::matmul`]
    /// each; a backend that prepares its input for a projection (a GPU's rounding to bf16)
    /// does so once for all of them.
    fn matmuls(
        &self,
        x: &DeviceBuffer,
        rows: usize,
        weights: &[WeightView<'_>],
        outs: &mut [&mut DeviceBuffer],
    ) -> Result<()> {
        for (w, out) in weights.iter().zip(outs.iter_mut()) {
            self.matmul(x, rows, *w, out)?;
        }
        Ok(())
    }
}

/// Attention: RoPE, the KV cache's stores, paged attention.
pub trait AttentionOps {
    /// Rotate-half RoPE in place on the first `rotary_dim` dims of each head of `x`
    /// (`[tokens, heads, head_dim]`), at each token's position, with `rope`'s frequencies.
    #[allow(clippy::too_many_arguments)]
    fn rope(
        &self,
        x: &mut DeviceBuffer,
        positions: &DeviceBuffer,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        rotary_dim: usize,
        rope: RopeParams,
    ) -> Result<()>;

    /// Writes each token's K and V (`[tokens, kv_heads · head_dim]`) to its slot of a layer's
    /// paged cache (`[slots, kv_row_elems]`).
    #[allow(clippy::too_many_arguments)]
    fn kv_store(
        &self,
        k: &DeviceBuffer,
        v: &DeviceBuffer,
        slots: &DeviceBuffer,
        tokens: usize,
        kv_heads: usize,
        head_dim: usize,
        cache_k: &mut DeviceBuffer,
        cache_v: &mut DeviceBuffer,
    ) -> Result<()>;

    /// From one fused projection `qkv` (`[tokens, (heads + 2 kv_heads) · head_dim]`: each
    /// token's q heads, then its k heads, then its v heads): q per-head RMSNorm'd and rotated
    /// into `q_out` (`[tokens, heads, head_dim]`), k RMSNorm'd and rotated, and v as it is,
    /// stored into the paged cache at each token's slot. One dispatch: what a QKV GEMM needs
    /// next, without the separate norm, rope and store.
    #[allow(clippy::too_many_arguments)]
    fn qkv_norm_rope_store(
        &self,
        qkv: &DeviceBuffer,
        q_weight: &DeviceBuffer,
        k_weight: &DeviceBuffer,
        positions: &DeviceBuffer,
        slots: &DeviceBuffer,
        shape: QkShape,
        q_out: &mut DeviceBuffer,
        cache_k: &mut DeviceBuffer,
        cache_v: &mut DeviceBuffer,
    ) -> Result<()>;

    /// Causal GQA attention of each token over positions `0..=position` of its sequence, read
    /// through the sequence's block table from a paged cache that already holds this batch's
    /// K and V. `q` is `[tokens, num_heads, head_dim]`; so is `out`, f32 or, where the backend
    /// takes projection inputs so ([`Device::gemm_input_dtype`](crate::Device::gemm_input_dtype)), bf16.
    fn paged_attention(
        &self,
        q: &DeviceBuffer,
        cache_k: &DeviceBuffer,
        cache_v: &DeviceBuffer,
        meta: &AttentionMeta<'_>,
        shape: AttentionShape,
        out: &mut DeviceBuffer,
    ) -> Result<()>;
}

/// Mixture-of-experts: routing, sorting, the grouped and per-token experts.
pub trait MoeOps {
    /// Softmax router: from `[tokens, num_experts]` logits, each token's `top_k` experts and
    /// weights (renormalised to sum 1 when `renormalize`). Ties go to the lower expert id.
    /// With `shared_gate`, each logits row has one more column, a shared expert's gate logit,
    /// and each token one more choice after its `top_k`: expert `num_experts` with weight
    /// sigmoid(that logit) (ids and weights are `[tokens, top_k + 1]`).
    #[allow(clippy::too_many_arguments)]
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
    ) -> Result<()>;

    /// `out[rows[i]] += scales[i] · y[i]` for `num_rows` rows of `dim` (scatter back to token
    /// order with routing weights). `rows` must not repeat.
    #[allow(clippy::too_many_arguments)]
    fn scale_scatter_add(
        &self,
        y: &DeviceBuffer,
        rows: &DeviceBuffer,
        scales: &DeviceBuffer,
        num_rows: usize,
        dim: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()>;

    /// Sorts the routed (token, slot) pairs by expert on the device: per-expert offsets, the
    /// experts hit, the permutation and its inverse ([`MoeSorted`]). No host round trip.
    fn moe_sort(
        &self,
        routing: MoeRouting<'_>,
        num_experts: usize,
        expert_offsets: &mut DeviceBuffer,
        hit_experts: &mut DeviceBuffer,
        sorted_pairs: &mut DeviceBuffer,
        pair_positions: &mut DeviceBuffer,
    ) -> Result<()>;

    /// Grouped gate and up projections and SwiGLU of every routed pair, all experts in one
    /// dispatch: `act[s] = silu(gate[e] x[t]) ⊙ up[e] x[t]` for the pair `(t, j)` at sorted
    /// position `s`, `e` its expert; x as [`Ops::matmul`] takes it. `act` is
    /// `[pairs, intermediate]` f32 in sorted order; it is scratch for
    /// [`Ops::moe_grouped_down`], which may find it in a layout of the backend's own (the
    /// CUDA backend's prefill tiles leave it in bf16).
    fn moe_grouped_gate_up(
        &self,
        x: &DeviceBuffer,
        routing: MoeRouting<'_>,
        sorted: MoeSorted<'_>,
        experts: &ExpertWeights,
        act: &mut DeviceBuffer,
    ) -> Result<()>;

    /// Grouped down projection scaled by each pair's routing weight, all experts in one
    /// dispatch: `y[s] = w[p] · down[e] act[s]`. `y` is `[pairs, hidden]` in sorted order.
    fn moe_grouped_down(
        &self,
        act: &DeviceBuffer,
        routing: MoeRouting<'_>,
        sorted: MoeSorted<'_>,
        experts: &ExpertWeights,
        y: &mut DeviceBuffer,
    ) -> Result<()>;

    /// Back to token order: `out[t] = Σ_j y[position of pair (t, j)]`, summed in slot order.
    fn moe_combine(
        &self,
        y: &DeviceBuffer,
        routing: MoeRouting<'_>,
        sorted: MoeSorted<'_>,
        hidden: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()>;

    /// [`Ops::moe_grouped_down`] then [`Ops::moe_combine`] into `out`, with `y` scratch
    /// in a type of the backend's choosing (the CUDA backend's prefill tiles leave it in bf16:
    /// half the bytes written and read back).
    fn moe_grouped_down_combine(
        &self,
        act: &DeviceBuffer,
        routing: MoeRouting<'_>,
        sorted: MoeSorted<'_>,
        experts: &ExpertWeights,
        y: &mut DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        self.moe_grouped_down(act, routing, sorted, experts, y)?;
        self.moe_combine(y, routing, sorted, experts.down.rows(), out)
    }

    /// Routed experts, one matrix-vector product per (token, expert) pair:
    /// `out[t] = Σ_j w[t,j] · down[e](silu(gate[e] x[t]) ⊙ up[e] x[t])` with `e = ids[t,j]`.
    /// Two dispatches: the gate/up half into `act` (`[pairs, intermediate]` scratch) and the
    /// down-and-combine half.
    fn moe_experts_per_token(
        &self,
        x: &DeviceBuffer,
        routing: MoeRouting<'_>,
        experts: &ExpertWeights,
        act: &mut DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()>;
}

/// The Gated DeltaNet's recurrent ops.
pub trait RecurrentOps {
    /// Depthwise causal convolution with SiLU over `[tokens, channels]`, kernel `[channels, k]`
    /// (F32), continuing each run from the last `k - 1` inputs kept in its state slot
    /// (`conv_state`: `[slots, channels, k - 1]`), which it then updates.
    #[allow(clippy::too_many_arguments)]
    fn causal_conv1d(
        &self,
        x: &DeviceBuffer,
        weight: &DeviceBuffer,
        channels: usize,
        kernel: usize,
        runs: RecurrentRuns<'_>,
        conv_state: &mut DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()>;

    /// Gated DeltaNet gates per token and value head: `beta = σ(b)` and
    /// `g = -exp(a_log) · softplus(a + dt_bias)` (`a_log`, `dt_bias` F32 `[heads]`).
    #[allow(clippy::too_many_arguments)]
    fn delta_net_gates(
        &self,
        a: &DeviceBuffer,
        b: &DeviceBuffer,
        a_log: &DeviceBuffer,
        dt_bias: &DeviceBuffer,
        tokens: usize,
        heads: usize,
        g: &mut DeviceBuffer,
        beta: &mut DeviceBuffer,
    ) -> Result<()>;

    /// The gated delta rule, as if token by token within each run (backends may compute it in
    /// the chunked form, picked by `runs.max_run_tokens`): q and k are L2-normalised per
    /// head (q then scaled by `key_dim^-1/2`), and per value head the fp32 state
    /// `S` (`[key_dim, value_dim]` in slot `recurrent_state[slot]`) is decayed by `exp(g)`,
    /// corrected by `beta (v - kᵀS)` along `k`, and read as `out = qᵀS`. `qkv` is the conv
    /// output `[tokens, 2·nk·dk + nv·dv]` (q, k, v blocks); `out` is `[tokens, nv, dv]`.
    #[allow(clippy::too_many_arguments)]
    fn gated_delta_rule(
        &self,
        qkv: &DeviceBuffer,
        g: &DeviceBuffer,
        beta: &DeviceBuffer,
        shape: DeltaNetShape,
        runs: RecurrentRuns<'_>,
        recurrent_state: &mut DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()>;
}

/// Sampling where the logits are.
pub trait SamplingOps {
    /// Applies sampling penalties to `logits` (`len` values) in place: `entries` is `[n,
    /// DRAW_WORDS]` u32 of [`sampling::Penalty::words`](crate::sampling::Penalty::words), at most one entry per logit.
    fn logit_penalties(
        &self,
        logits: &mut DeviceBuffer,
        len: usize,
        entries: &DeviceBuffer,
        n: usize,
    ) -> Result<()>;

    /// Reduces each row of `logits` (`[rows, vocab]` f32) to its best candidates, normalisers
    /// and Gumbel draw (`[rows, CANDIDATE_ROW_WORDS]` u32 into `out`, read with
    /// [`sampling::RowCandidates::from_words`](crate::sampling::RowCandidates::from_words)); `draws` is `[rows, DRAW_WORDS]` u32 of
    /// [`sampling::RowDraw::words`](crate::sampling::RowDraw::words).
    fn top_candidates(
        &self,
        logits: &DeviceBuffer,
        rows: usize,
        vocab: usize,
        draws: &DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()>;

    /// Each row's greedy token: `ids[r]` (u32) the id of the largest finite logit of row `r`
    /// of `logits` (`[rows, vocab]` f32), ties to the lower id, or
    /// [`sampling::NO_FINITE_LOGIT`](crate::sampling::NO_FINITE_LOGIT) where none is finite.
    /// Chosen where the logits are, so that a pass that reads the token (a draft head's next
    /// one) needs no read-back between them.
    fn argmax(
        &self,
        logits: &DeviceBuffer,
        rows: usize,
        vocab: usize,
        ids: &mut DeviceBuffer,
    ) -> Result<()>;
}

/// [`Ops::matmuls`]'s check (in its `dyn Backend` entry): as many outputs as weights.
pub(crate) fn matmuls_arity(weights: usize, outs: usize) -> Result<()> {
    if weights != outs {
        return Err(BackendError::BadArgument {
            op: "matmuls",
            detail: format!("{weights} weights for {outs} outputs"),
        });
    }
    Ok(())
}

/// Checks a copy of `count` whole blocks of `block_elems` elements between `paged` and
/// `packed` (one stored type, `packed` long enough); the blocks `paged` holds.
pub(crate) fn check_block_copy(
    op: &'static str,
    paged: &DeviceBuffer,
    packed: &DeviceBuffer,
    count: usize,
    block_elems: usize,
) -> Result<usize> {
    let bad = |detail: String| BackendError::BadArgument { op, detail };
    if paged.dtype() != packed.dtype() {
        return Err(bad(format!(
            "blocks of {} copied to or from a buffer of {}",
            paged.dtype(),
            packed.dtype()
        )));
    }
    if block_elems == 0 {
        return Err(bad("blocks of 0 elements".to_string()));
    }
    if count
        .checked_mul(block_elems)
        .is_none_or(|n| n > packed.len())
    {
        return Err(bad(format!(
            "{count} blocks of {block_elems} elements in a packed buffer of {}",
            packed.len()
        )));
    }
    Ok(paged.len() / block_elems)
}

/// Checks [`Ops::copy_within`]'s ranges against a buffer of `len` elements.
pub(crate) fn check_copy_ranges(
    op: &'static str,
    len: usize,
    src: usize,
    dst: usize,
    count: usize,
) -> Result<()> {
    let fits = |start: usize| start.checked_add(count).is_some_and(|end| end <= len);
    let apart = src.abs_diff(dst) >= count;
    if fits(src) && fits(dst) && apart {
        Ok(())
    } else {
        Err(BackendError::BadArgument {
            op,
            detail: format!(
                "copying {count} elements from {src} to {dst} in a buffer of {len}: out of \
                 range or overlapping"
            ),
        })
    }
}

/// Checks a byte range of [`Buffers::read_bytes`](crate::Buffers::read_bytes) / [`Buffers::write_bytes`](crate::Buffers::write_bytes) against a buffer:
/// the element range it covers, `(first byte, bytes)`.
pub fn byte_range(
    op: &'static str,
    b: &DeviceBuffer,
    offset: usize,
    bytes: usize,
) -> Result<(usize, usize)> {
    if let DType::Quant(format) = b.dtype() {
        return Err(BackendError::BadArgument {
            op,
            detail: format!("byte ranges of {} blocks", format.name()),
        });
    }
    let size = b.dtype().size_bytes();
    let elems = bytes / size;
    let fits = offset.checked_add(elems).is_some_and(|end| end <= b.len());
    if !bytes.is_multiple_of(size) || !fits {
        return Err(BackendError::BadArgument {
            op,
            detail: format!(
                "{bytes} bytes from element {offset} of a buffer of {} {:?} elements",
                b.len(),
                b.dtype()
            ),
        });
    }
    Ok((offset * size, bytes))
}

/// [`Ops::matmul_parts`] part by part through [`Ops::matmul_columns`]: the default,
/// and what a backend that shares work between parts falls back to.
pub fn matmul_parts_by_columns<B: MatmulOps + ?Sized>(
    backend: &B,
    x: &DeviceBuffer,
    rows: usize,
    (parts, cols): (&[(DeviceBuffer, usize)], usize),
    out: &mut DeviceBuffer,
    out_cols: usize,
) -> Result<()> {
    let mut col0 = 0;
    for (w, part_rows) in parts {
        let view = WeightView::new(w, *part_rows, cols)?;
        backend.matmul_columns(x, rows, view, out, out_cols, col0)?;
        col0 += part_rows;
    }
    Ok(())
}
