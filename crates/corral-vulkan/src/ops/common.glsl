// What every shader shares: buffers reached by their device addresses (no descriptor sets,
// no binding-size limit), read as f32, u32 or 16-bit words; weights of any float type or
// block format; the fault word where an index out of range is reported.
#extension GL_EXT_buffer_reference : require
#extension GL_EXT_shader_explicit_arithmetic_types_int64 : require
#extension GL_EXT_shader_explicit_arithmetic_types_int16 : require
#extension GL_EXT_shader_16bit_storage : require
#ifdef COOPMAT
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_KHR_shader_subgroup_basic : require
#endif

// Invocations of a workgroup: 256 unless the shader defines GROUP_SIZE before including
// this file.
#ifndef GROUP_SIZE
#define GROUP_SIZE 256
#endif
layout(local_size_x = GROUP_SIZE) in;

layout(buffer_reference, std430, buffer_reference_align = 4) buffer Floats {
    float v[];
};
layout(buffer_reference, std430, buffer_reference_align = 4) buffer Uints {
    uint v[];
};
layout(buffer_reference, std430, buffer_reference_align = 16) buffer Quads {
    uvec4 v[];
};
layout(buffer_reference, std430, buffer_reference_align = 2) buffer Halves {
    uint16_t v[];
};
layout(buffer_reference, std430, buffer_reference_align = 4) buffer Fault {
    uint code;
};

#include "blocks.glsl"

// Weight element types, as the host passes them (`weight_type` in ops/mod.rs); block
// formats follow from 3 (blocks.glsl).
const uint WEIGHT_F32 = 0;
const uint WEIGHT_BF16 = 1;
const uint WEIGHT_F16 = 2;

// Element `i` of weights of type `type` starting at address `base`.
float weight_at(uint64_t base, uint type, uint64_t i) {
    if (type == WEIGHT_F32) {
        return Floats(base + 4 * i).v[0];
    }
    if (type > WEIGHT_F16) {
        return block_weight_at(base, type, i);
    }
    uint bits = uint(Halves(base + 2 * i).v[0]);
    if (type == WEIGHT_BF16) {
        return uintBitsToFloat(bits << 16);
    }
    return unpackHalf2x16(bits).x;
}

// Fault codes (`fault` in backend.rs).
const uint FAULT_TOKEN_ID = 1;
const uint FAULT_ROW_INDEX = 2;
const uint FAULT_PENALTY_INDEX = 3;
const uint FAULT_KV_SLOT = 4;
const uint FAULT_BLOCK_TABLE = 5;
const uint FAULT_EXPERT_ID = 6;
const uint FAULT_RECURRENT_RUN = 7;
const uint FAULT_RUN_LENGTH = 8;

void report(Fault fault, uint code) {
    atomicMax(fault.code, code);
}

float sigmoid(float x) {
    return 1.0 / (1.0 + exp(-x));
}

// The workgroup's number in a dispatch of more than 65535 groups, laid out as
// [min(groups, 65535), ceil(groups / 65535)] (`Grid` in ops/mod.rs).
uint flat_group() {
    return gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
}

// The invocation's number across such a dispatch.
uint flat_index() {
    return flat_group() * GROUP_SIZE + gl_LocalInvocationID.x;
}

// Expert `e`'s matrix address from a table of 64-bit addresses (two words each).
uint64_t expert_at(Uints table, uint e) {
    return uint64_t(table.v[2 * e]) | (uint64_t(table.v[2 * e + 1]) << 32);
}
