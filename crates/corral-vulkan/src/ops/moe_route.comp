// The softmax router, one workgroup a token: its `top_k` experts by logit (ties to the lower
// id) and their softmax weights, renormalised to sum 1 where `renormalize`; with
// `shared_gate`, one more logit a row and one more choice, expert `num_experts` weighted by
// its sigmoid.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "reduce.glsl"

layout(push_constant) uniform Args {
    Floats logits;
    Uints ids;
    Floats weights;
    uint tokens;
    uint num_experts;
    uint top_k;
    uint renormalize;
    uint shared_gate;
} args;

const uint NONE = 0xffffffffu;

shared float pick_value[GROUP_SIZE];
shared uint pick_id[GROUP_SIZE];

bool before(float a, uint ai, float b, uint bi) {
    return ai != NONE && (bi == NONE || a > b || (a == b && ai < bi));
}

void main() {
    uint t = flat_group();
    if (t >= args.tokens) {
        return;
    }
    uint lane = gl_LocalInvocationID.x;
    uint row = args.num_experts + args.shared_gate;
    uint base = t * row;
    float m = uintBitsToFloat(0xff800000u);
    for (uint e = lane; e < args.num_experts; e += GROUP_SIZE) {
        m = max(m, args.logits.v[base + e]);
    }
    m = workgroup_max(m);
    float sum = 0.0;
    for (uint e = lane; e < args.num_experts; e += GROUP_SIZE) {
        sum += exp(args.logits.v[base + e] - m);
    }
    sum = workgroup_sum(sum);
    uint choices = args.top_k + args.shared_gate;
    float last = 0.0;
    uint last_id = NONE;
    float total = 0.0;
    for (uint j = 0; j < args.top_k; j++) {
        float best = 0.0;
        uint best_id = NONE;
        for (uint e = lane; e < args.num_experts; e += GROUP_SIZE) {
            float l = args.logits.v[base + e];
            bool after_last = last_id == NONE || before(last, last_id, l, e);
            if (after_last && before(l, e, best, best_id)) {
                best = l;
                best_id = e;
            }
        }
        pick_value[lane] = best;
        pick_id[lane] = best_id;
        barrier();
        for (uint half_ = GROUP_SIZE / 2; half_ > 0; half_ /= 2) {
            if (lane < half_
                    && before(pick_value[lane + half_], pick_id[lane + half_], pick_value[lane],
                              pick_id[lane])) {
                pick_value[lane] = pick_value[lane + half_];
                pick_id[lane] = pick_id[lane + half_];
            }
            barrier();
        }
        last = pick_value[0];
        last_id = pick_id[0];
        barrier();
        float p = exp(last - m) / sum;
        total += p;
        if (lane == 0) {
            args.ids.v[t * choices + j] = last_id;
            args.weights.v[t * choices + j] = p;
        }
    }
    if (lane == 0) {
        if (args.renormalize != 0) {
            for (uint j = 0; j < args.top_k; j++) {
                args.weights.v[t * choices + j] /= total;
            }
        }
        if (args.shared_gate != 0) {
            args.ids.v[t * choices + args.top_k] = args.num_experts;
            args.weights.v[t * choices + args.top_k] = sigmoid(args.logits.v[base + args.num_experts]);
        }
    }
}
