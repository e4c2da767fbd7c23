// Sums and maxima over a workgroup, by subgroups then through shared memory.
// Every invocation of the workgroup calls it, in uniform control flow.
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require

shared float subgroup_sums[GROUP_SIZE];

float workgroup_sum(float v) {
    v = subgroupAdd(v);
    if (subgroupElect()) {
        subgroup_sums[gl_SubgroupID] = v;
    }
    barrier();
    float total = 0.0;
    for (uint s = 0; s < gl_NumSubgroups; s++) {
        total += subgroup_sums[s];
    }
    barrier();
    return total;
}

// The largest of `v` over the workgroup, to every invocation (as `workgroup_sum`).
float workgroup_max(float v) {
    v = subgroupMax(v);
    if (subgroupElect()) {
        subgroup_sums[gl_SubgroupID] = v;
    }
    barrier();
    float m = subgroup_sums[0];
    for (uint s = 1; s < gl_NumSubgroups; s++) {
        m = max(m, subgroup_sums[s]);
    }
    barrier();
    return m;
}
