// A streaming band-limited resampler for the AudioWorklets (capture: the context's rate -> 24 kHz; player:
// 24 kHz -> the context's rate). Windowed-sinc interpolation at any ratio: each output sample is the sum of the
// input samples within `halfWidth` taps (at the lower of the two rates) weighted by a Blackman-windowed sinc whose
// cutoff is 0.95 x the lower Nyquist frequency, so downsampling does not alias. The kernel is tabulated once
// (TABLE_STEPS points per input sample, linearly interpolated). State carries across calls, so a stream cut into
// 128-sample render quanta comes out as if resampled whole (delay: `halfWidth` taps).

const TABLE_STEPS = 256;

export class Resampler {
  /** @param {number} inRate  @param {number} outRate  @param {number} halfWidth taps each side at the lower rate */
  constructor(inRate, outRate, halfWidth = 16) {
    if (!(inRate > 0 && outRate > 0)) throw new RangeError(`bad rates ${inRate} -> ${outRate}`);
    this.step = inRate / outRate; // input samples per output sample
    this.cutoff = Math.min(1, outRate / inRate) * 0.95; // of the input's Nyquist frequency
    this.reach = Math.ceil(halfWidth / Math.min(1, outRate / inRate)); // taps each side, at the input rate
    const n = 2 * this.reach * TABLE_STEPS + 2;
    this.table = new Float32Array(n); // kernel at offsets -reach .. +reach input samples
    for (let i = 0; i < n; i++) {
      const x = i / TABLE_STEPS - this.reach;
      const s = x === 0 ? 1 : Math.sin(Math.PI * this.cutoff * x) / (Math.PI * this.cutoff * x);
      const w = 0.42 + 0.5 * Math.cos(Math.PI * x / this.reach) + 0.08 * Math.cos(2 * Math.PI * x / this.reach);
      this.table[i] = Math.abs(x) >= this.reach ? 0 : this.cutoff * s * w;
    }
    this.buf = new Float32Array(2 * this.reach + 4096); // pending input; grows only if a caller pushes > 4096
    this.len = this.reach; // `reach` zeros of history: the first output is centred on input sample 0
    this.pos = this.reach; // where the next output sample falls, in buf's sample units
  }

  /** @param {Float32Array} input  @returns {Float32Array} the output samples this input completes */
  process(input) {
    if (this.len + input.length > this.buf.length) {
      const bigger = new Float32Array(2 * (this.len + input.length));
      bigger.set(this.buf.subarray(0, this.len));
      this.buf = bigger;
    }
    this.buf.set(input, this.len);
    this.len += input.length;
    const count = Math.max(0, Math.floor((this.len - this.reach - 1 - this.pos) / this.step) + 1);
    const out = new Float32Array(count);
    const { buf, table, reach } = this;
    for (let o = 0; o < count; o++) {
      const t = this.pos;
      const centre = Math.floor(t);
      let acc = 0;
      for (let k = centre - reach + 1; k <= centre + reach; k++) {
        const f = (k - t + reach) * TABLE_STEPS; // table index of offset (k - t)
        const i = f | 0;
        acc += buf[k] * (table[i] + (table[i + 1] - table[i]) * (f - i));
      }
      out[o] = acc;
      this.pos += this.step;
    }
    // keep what the next outputs still need: from `reach` samples before the next position on
    const drop = Math.max(0, Math.floor(this.pos) - reach);
    this.buf.copyWithin(0, drop, this.len);
    this.len -= drop;
    this.pos -= drop;
    return out;
  }
}
