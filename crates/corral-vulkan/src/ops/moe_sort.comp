// The routed pairs sorted by expert, stably, by one workgroup: each expert's count, their
// prefix sums (`offsets`, `[experts + 1]`), the experts hit (their count, then their ids in
// ascending order), each sorted position's pair and each pair's position. Pairs are placed
// GROUP_SIZE at a time, each after the earlier pairs of its expert. An expert id past
// `num_experts` is reported as a fault.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(push_constant) uniform Args {
    Uints ids;
    Uints offsets;
    Uints hit;
    Uints sorted_pairs;
    Uints positions;
    Fault fault;
    uint pairs;
    uint num_experts;
} args;

// MAX_EXPERTS (4096) counts, then cursors.
shared uint cursor[4096];
shared uint lane_expert[GROUP_SIZE];
shared uint totals[GROUP_SIZE];

// Exclusive prefix sums of `value` over the workgroup's lanes, and the total in `totals[0]`
// ... returned as (prefix, total).
uvec2 scan(uint value) {
    uint lane = gl_LocalInvocationID.x;
    totals[lane] = value;
    barrier();
    if (lane == 0) {
        uint run = 0;
        for (uint i = 0; i < GROUP_SIZE; i++) {
            uint v = totals[i];
            totals[i] = run;
            run += v;
        }
        lane_expert[0] = run;
    }
    barrier();
    uvec2 r = uvec2(totals[lane], lane_expert[0]);
    barrier();
    return r;
}

void main() {
    uint lane = gl_LocalInvocationID.x;
    uint experts = args.num_experts;
    for (uint e = lane; e < experts; e += GROUP_SIZE) {
        cursor[e] = 0;
    }
    barrier();
    for (uint p = lane; p < args.pairs; p += GROUP_SIZE) {
        uint e = args.ids.v[p];
        if (e >= experts) {
            report(args.fault, FAULT_EXPERT_ID);
        } else {
            atomicAdd(cursor[e], 1);
        }
    }
    barrier();
    // Each lane takes a span of consecutive experts: their counts' prefix sums and hits.
    uint span = (experts + GROUP_SIZE - 1) / GROUP_SIZE;
    uint first = min(lane * span, experts);
    uint end = min(first + span, experts);
    uint count = 0;
    uint hits = 0;
    for (uint e = first; e < end; e++) {
        count += cursor[e];
        hits += cursor[e] != 0 ? 1 : 0;
    }
    uvec2 at = scan(count);
    uvec2 hit_at = scan(hits);
    uint run = at.x;
    uint hit_run = hit_at.x;
    for (uint e = first; e < end; e++) {
        uint c = cursor[e];
        args.offsets.v[e] = run;
        if (c != 0) {
            args.hit.v[1 + hit_run] = e;
            hit_run++;
        }
        cursor[e] = run;
        run += c;
    }
    if (lane == 0) {
        args.offsets.v[experts] = at.y;
        args.hit.v[0] = hit_at.y;
    }
    barrier();
    // Stable placement, GROUP_SIZE pairs at a time.
    for (uint base = 0; base < args.pairs; base += GROUP_SIZE) {
        uint p = base + lane;
        uint e = p < args.pairs ? args.ids.v[p] : 0xffffffffu;
        lane_expert[lane] = e;
        barrier();
        if (e < experts) {
            uint rank = 0;
            for (uint i = 0; i < lane; i++) {
                rank += lane_expert[i] == e ? 1 : 0;
            }
            uint s = cursor[e] + rank;
            args.sorted_pairs.v[s] = p;
            args.positions.v[p] = s;
        }
        barrier();
        // The last lane of each expert in this group moves its cursor past the group's pairs.
        if (e < experts) {
            bool last = true;
            for (uint i = lane + 1; i < GROUP_SIZE; i++) {
                last = last && lane_expert[i] != e;
            }
            if (last) {
                uint n = 0;
                for (uint i = 0; i <= lane; i++) {
                    n += lane_expert[i] == e ? 1 : 0;
                }
                cursor[e] += n;
            }
        }
        barrier();
    }
}
