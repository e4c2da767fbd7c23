// Each `vocab`-wide row's first id of its largest finite logit (0xffffffff where none is
// finite), one workgroup a row.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(push_constant) uniform Args {
    Floats logits;
    Uints ids;
    uint vocab;
    uint rows;
} args;

shared float best_value[GROUP_SIZE];
shared uint best_id[GROUP_SIZE];

const uint NONE = 0xffffffffu;

void main() {
    uint row = flat_group();
    if (row >= args.rows) {
        return;
    }
    uint lane = gl_LocalInvocationID.x;
    uint base = row * args.vocab;
    float value = 0.0;
    uint id = NONE;
    for (uint i = lane; i < args.vocab; i += GROUP_SIZE) {
        float l = args.logits.v[base + i];
        if (!isinf(l) && !isnan(l) && (id == NONE || l > value)) {
            value = l;
            id = i;
        }
    }
    best_value[lane] = value;
    best_id[lane] = id;
    barrier();
    for (uint half_ = GROUP_SIZE / 2; half_ > 0; half_ /= 2) {
        if (lane < half_) {
            uint other = best_id[lane + half_];
            float v = best_value[lane + half_];
            uint mine = best_id[lane];
            if (other != NONE && (mine == NONE || v > best_value[lane]
                    || (v == best_value[lane] && other < mine))) {
                best_value[lane] = v;
                best_id[lane] = other;
            }
        }
        barrier();
    }
    if (lane == 0) {
        args.ids.v[row] = best_id[0];
    }
}
