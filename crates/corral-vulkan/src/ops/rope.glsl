// Rotate-half RoPE to the references' precision: the angle formed in f32 from the host's
// f32 inverse frequencies (as transformers forms it), its sine and cosine and the rotation in
// double (a GPU's f32 sin and cos lose the angle's value past a few radians).

// sin and cos of `a` to double precision: reduced by multiples of pi/2 in double, then the
// Taylor series over [-pi/4, pi/4].
dvec2 sin_cos(float a) {
    double x = double(a);
    double k = roundEven(x * 0.63661977236758134308lf);
    double r = (x - k * 1.5707963267948966192lf) - k * 6.123233995736766036e-17lf;
    double r2 = r * r;
    double s = r * (1.0lf + r2 * (-1.0lf / 6.0lf + r2 * (1.0lf / 120.0lf + r2 * (-1.0lf / 5040.0lf
        + r2 * (1.0lf / 362880.0lf + r2 * (-1.0lf / 39916800.0lf + r2 * (1.0lf / 6227020800.0lf
        + r2 * (-1.0lf / 1307674368000.0lf))))))));
    double c = 1.0lf + r2 * (-0.5lf + r2 * (1.0lf / 24.0lf + r2 * (-1.0lf / 720.0lf
        + r2 * (1.0lf / 40320.0lf + r2 * (-1.0lf / 3628800.0lf + r2 * (1.0lf / 479001600.0lf
        + r2 * (-1.0lf / 87178291200.0lf + r2 * (1.0lf / 20922789888000.0lf))))))));
    int q = int(mod(k, 4.0lf));
    if (q == 0) {
        return dvec2(s, c);
    } else if (q == 1) {
        return dvec2(c, -s);
    } else if (q == 2) {
        return dvec2(-s, -c);
    }
    return dvec2(-c, s);
}

// The pair (a, b) = (x[i], x[i + half]) of a head at position `pos` rotated by pair `i`'s
// inverse frequency, scaled by `factor` (YaRN's attention factor, else 1).
vec2 rotate(float a, float b, uint pos, float inv_freq, float factor) {
    precise float angle = float(pos) * inv_freq;
    dvec2 sc = sin_cos(angle);
    double da = double(a);
    double db = double(b);
    double f = double(factor);
    return vec2(float((da * sc.y - db * sc.x) * f), float((db * sc.y + da * sc.x) * f));
}
