// Teams of TEAM invocations (the device's subgroup, at most 32), each team a dot product of a weight row with a vector: every
// invocation takes 16 columns at a time (`weight_part`), reading the row in order across
// the team, and the team's shares are added through shared memory. Include after
// parts.glsl, with GROUP_SIZE a multiple of TEAM.

// The team's size, set when the pipeline is made (`VulkanDevice::team_size`): a power of
// two from 4 to 32.
layout(constant_id = 0) const uint TEAM = 32;
const uint TEAMS = GROUP_SIZE / TEAM;

shared float team_sums[GROUP_SIZE];

// This invocation's place in its team, and its team's in the workgroup.
uint team_lane() {
    return gl_LocalInvocationID.x % TEAM;
}

uint team_index() {
    return gl_LocalInvocationID.x / TEAM;
}

// The item (an output of a dispatch) this invocation's team computes.
uint team_item() {
    return flat_group() * TEAMS + team_index();
}

// This invocation's share of the dot product of the weight row starting at element `row`
// (`cols` wide, weights of type `type` at `base`) with x.v[x_at .. x_at + cols].
float lane_dot(uint64_t base, uint type, uint64_t row, uint cols, Floats x, uint x_at) {
    float acc = 0.0;
    for (uint k0 = team_lane() * 16; k0 < cols; k0 += TEAM * 16) {
        float w[16];
        weight_part(base, type, row, k0, cols, w);
        for (uint i = 0; i < 16; i++) {
            acc += w[i] * x.v[x_at + min(k0 + i, cols - 1)];
        }
    }
    return acc;
}

// The sum of `v` over each team, in the team's first invocation (the others get their own
// `v` back). Every invocation of the workgroup calls it, in uniform control flow.
float team_sum(float v) {
    team_sums[gl_LocalInvocationID.x] = v;
    barrier();
    float total = v;
    if (team_lane() == 0) {
        for (uint l = 1; l < TEAM; l++) {
            total += team_sums[gl_LocalInvocationID.x + l];
        }
    }
    barrier();
    return total;
}
