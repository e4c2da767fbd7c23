// One row's reduction a workgroup (`sampling.rs` of corral-backend defines it): the best
// TOP_CANDIDATES finite logits (larger first, ties to the lower id), the largest logit,
// ln sum exp(l) and ln sum exp(l / T), and the Gumbel-max draw argmax(l / T + G) where the
// row's draw asks for one. Each invocation keeps the best of its strided share not taken
// yet; a round takes the workgroup's best, and only its owner looks again.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "reduce.glsl"

layout(push_constant) uniform Args {
    Floats logits;
    Uints draws;
    Uints out_;
    uint vocab;
    uint rows;
} args;

const uint TOP = 64;
const uint ROW_WORDS = 2 * TOP + 8;
const uint NONE = 0xffffffffu;

shared float pick_value[GROUP_SIZE];
shared uint pick_id[GROUP_SIZE];
shared float pick_logit[GROUP_SIZE];

bool finite(float l) {
    return !isinf(l) && !isnan(l);
}

// Whether (a, ai) comes before (b, bi): larger value first, then lower id; no id is last.
bool before(float a, uint ai, float b, uint bi) {
    return ai != NONE && (bi == NONE || a > b || (a == b && ai < bi));
}

// The workgroup's first (value, id, logit) in `before`'s order, to every invocation.
void reduce_pick(inout float value, inout uint id, inout float logit) {
    uint lane = gl_LocalInvocationID.x;
    pick_value[lane] = value;
    pick_id[lane] = id;
    pick_logit[lane] = logit;
    barrier();
    for (uint half_ = GROUP_SIZE / 2; half_ > 0; half_ /= 2) {
        if (lane < half_
                && before(pick_value[lane + half_], pick_id[lane + half_], pick_value[lane],
                          pick_id[lane])) {
            pick_value[lane] = pick_value[lane + half_];
            pick_id[lane] = pick_id[lane + half_];
            pick_logit[lane] = pick_logit[lane + half_];
        }
        barrier();
    }
    value = pick_value[0];
    id = pick_id[0];
    logit = pick_logit[0];
    barrier();
}

float gumbel(uint64_t key, uint id) {
    uint64_t z = key + (uint64_t(id) + 1ul) * 0x9E3779B97F4A7C15ul;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ul;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBul;
    z ^= z >> 31;
    precise float u = (float(uint(z >> 41)) + 0.5) * (1.0 / 8388608.0);
    return -log(-log(u));
}

void main() {
    uint row = flat_group();
    if (row >= args.rows) {
        return;
    }
    uint lane = gl_LocalInvocationID.x;
    uint base = row * args.vocab;
    float inv_t = uintBitsToFloat(args.draws.v[4 * row]);
    uint64_t key = uint64_t(args.draws.v[4 * row + 1])
        | (uint64_t(args.draws.v[4 * row + 2]) << 32);
    bool draw = args.draws.v[4 * row + 3] != 0;

    // The largest finite logit, and this invocation's best of its share.
    float head = 0.0;
    uint head_id = NONE;
    float score = 0.0;
    uint score_id = NONE;
    float score_logit = 0.0;
    for (uint i = lane; i < args.vocab; i += GROUP_SIZE) {
        float l = args.logits.v[base + i];
        if (!finite(l)) {
            continue;
        }
        if (before(l, i, head, head_id)) {
            head = l;
            head_id = i;
        }
        if (draw) {
            precise float s = l * inv_t + gumbel(key, i);
            if (before(s, i, score, score_id)) {
                score = s;
                score_id = i;
                score_logit = l;
            }
        }
    }
    float max_value = head;
    uint max_id = head_id;
    float unused = 0.0;
    reduce_pick(max_value, max_id, unused);
    reduce_pick(score, score_id, score_logit);

    // The normalisers, around the largest logit.
    float m = max_id == NONE ? 0.0 : max_value;
    float sum = 0.0;
    float tempered = 0.0;
    for (uint i = lane; i < args.vocab; i += GROUP_SIZE) {
        float l = args.logits.v[base + i];
        if (finite(l)) {
            sum += exp(l - m);
            tempered += exp(l * inv_t - m * inv_t);
        }
    }
    sum = workgroup_sum(sum);
    tempered = workgroup_sum(tempered);

    // The candidates, one a round.
    uint out_base = row * ROW_WORDS;
    uint count = 0;
    for (uint r = 0; r < TOP; r++) {
        float value = head;
        uint id = head_id;
        float logit = head;
        reduce_pick(value, id, logit);
        if (id == NONE) {
            break;
        }
        if (lane == 0) {
            args.out_.v[out_base + r] = id;
            args.out_.v[out_base + TOP + r] = floatBitsToUint(value);
        }
        count++;
        if (id == head_id) {
            // Taken: the best of this share after it.
            float taken = head;
            uint taken_id = head_id;
            head_id = NONE;
            for (uint i = lane; i < args.vocab; i += GROUP_SIZE) {
                float l = args.logits.v[base + i];
                if (finite(l) && before(taken, taken_id, l, i) && before(l, i, head, head_id)) {
                    head = l;
                    head_id = i;
                }
            }
        }
    }
    if (lane == 0) {
        for (uint r = count; r < TOP; r++) {
            args.out_.v[out_base + r] = 0;
            args.out_.v[out_base + TOP + r] = 0;
        }
        bool any = max_id != NONE;
        float neg_inf = uintBitsToFloat(0xff800000u);
        args.out_.v[out_base + 2 * TOP] = count;
        args.out_.v[out_base + 2 * TOP + 1] = floatBitsToUint(any ? max_value : neg_inf);
        args.out_.v[out_base + 2 * TOP + 2] = floatBitsToUint(any ? m + log(sum) : neg_inf);
        args.out_.v[out_base + 2 * TOP + 3] =
            floatBitsToUint(any ? m * inv_t + log(tempered) : neg_inf);
        args.out_.v[out_base + 2 * TOP + 4] = draw ? score_id : NONE;
        args.out_.v[out_base + 2 * TOP + 5] = draw ? floatBitsToUint(score_logit) : 0;
        args.out_.v[out_base + 2 * TOP + 6] = 0;
        args.out_.v[out_base + 2 * TOP + 7] = 0;
    }
}
