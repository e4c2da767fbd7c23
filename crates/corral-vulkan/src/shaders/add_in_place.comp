// acc[i] += x[i] for the first `len` elements: buffers reached by their device addresses
// (no descriptor sets, no binding-size limit), arguments as push constants.
#version 450
#extension GL_EXT_buffer_reference : require
#extension GL_EXT_shader_explicit_arithmetic_types_int64 : require

layout(local_size_x = 256) in;

layout(buffer_reference, std430, buffer_reference_align = 4) buffer Floats {
    float v[];
};

layout(push_constant) uniform Args {
    Floats acc;
    Floats x;
    uint len;
} args;

void main() {
    uint i = gl_GlobalInvocationID.x;
    if (i < args.len) {
        args.acc.v[i] += args.x.v[i];
    }
}
