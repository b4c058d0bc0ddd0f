// AudioWorklet "capture": the microphone (or any input) cut into 20 ms frames on the audio thread.
//
// Every frame posts {type: "level", rms, peak, time} (time: the context's clock at the frame's end, seconds), which
// drives the level meter and the page's own voice activity (the latency meter). With processorOptions.send, each
// frame is also resampled to 24 kHz and posted as {type: "pcm", pcm: Int16Array(480)} (PCM16 mono, transferred,
// not copied): what the WebSocket fallback sends in input_audio_buffer.append. Input channels are averaged to mono.

import { Resampler } from "./resampler.js";

const OUT_RATE = 24000;
const OUT_FRAME = OUT_RATE / 50; // 480 samples: 20 ms

class Capture extends AudioWorkletProcessor {
  constructor(options) {
    super();
    this.send = Boolean(options.processorOptions && options.processorOptions.send);
    this.frame = Math.round(sampleRate / 50); // context-rate samples per 20 ms level frame
    this.sumSq = 0;
    this.peak = 0;
    this.count = 0;
    this.resampler = this.send ? new Resampler(sampleRate, OUT_RATE) : null;
    this.pending = new Int16Array(OUT_FRAME); // the 24 kHz frame being filled
    this.filled = 0;
    this.stopped = false;
    this.port.onmessage = (e) => {
      if (e.data && e.data.type === "stop") this.stopped = true;
    };
  }

  process(inputs) {
    if (this.stopped) return false;
    const channels = inputs[0];
    if (!channels || channels.length === 0) return true; // no input connected (yet): keep running
    const n = channels[0].length;
    const mono = channels.length === 1 ? channels[0] : new Float32Array(n);
    if (channels.length > 1) {
      for (const ch of channels) for (let i = 0; i < n; i++) mono[i] += ch[i] / channels.length;
    }
    for (let i = 0; i < n; i++) {
      const v = mono[i];
      this.sumSq += v * v;
      const a = Math.abs(v);
      if (a > this.peak) this.peak = a;
      if (++this.count === this.frame) {
        this.port.postMessage({ type: "level", rms: Math.sqrt(this.sumSq / this.count), peak: this.peak,
                                time: currentTime + (i + 1) / sampleRate });
        this.sumSq = 0;
        this.peak = 0;
        this.count = 0;
      }
    }
    if (this.resampler) this.push(this.resampler.process(mono));
    return true;
  }

  push(samples) {
    for (let i = 0; i < samples.length; i++) {
      const v = Math.max(-1, Math.min(1, samples[i]));
      this.pending[this.filled++] = v < 0 ? v * 32768 : v * 32767;
      if (this.filled === OUT_FRAME) {
        this.port.postMessage({ type: "pcm", pcm: this.pending }, [this.pending.buffer]);
        this.pending = new Int16Array(OUT_FRAME);
        this.filled = 0;
      }
    }
  }
}

registerProcessor("capture", Capture);
