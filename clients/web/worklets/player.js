// AudioWorklet "player": the WebSocket fallback's loudspeaker. The page posts the reply's audio as it arrives
// (response.output_audio.delta: PCM16 mono 24 kHz) and this plays it gaplessly at the context's rate.
//
// In:  {type: "push", id, pcm: Int16Array}  audio of assistant item `id` (resampled here, queued)
//      {type: "clear"}                      barge-in: drop everything queued NOW; answered with "cleared"
//      {type: "sync", token}                answered {type: "synced", token} once the messages before it are handled
// Out: {type: "started", id}                the item's first sample went to the output
//      {type: "idle", id, playedMs}         the queue ran dry (the reply so far has been played)
//      {type: "cleared", id, playedMs, droppedMs}  after "clear": what of item `id` had been played (the
//                                           page truncates the item there), what was dropped
//      {type: "overflow", id, droppedMs}    the queue is full (MAX_QUEUED_S): this audio was not queued
// The queue is bounded (MAX_QUEUED_S of audio); the page keeps nothing else.

import { Resampler } from "./resampler.js";

const IN_RATE = 24000;
const MAX_QUEUED_S = 180;

class Player extends AudioWorkletProcessor {
  constructor() {
    super();
    this.reset();
    this.port.onmessage = (e) => this.onMessage(e.data);
  }

  reset() {
    this.queue = []; // [{id, samples: Float32Array at sampleRate, offset}]
    this.queued = 0; // samples in the queue not yet played
    this.resampler = new Resampler(IN_RATE, sampleRate);
    this.current = null; // the id being played
    this.played = 0; // samples of `current` played
    this.playing = false;
  }

  onMessage(m) {
    if (!m) return;
    if (m.type === "push") {
      const f = new Float32Array(m.pcm.length);
      for (let i = 0; i < f.length; i++) f[i] = m.pcm[i] / 32768;
      const samples = this.resampler.process(f);
      if (this.queued + samples.length > MAX_QUEUED_S * sampleRate) {
        this.port.postMessage({ type: "overflow", id: m.id, droppedMs: (1000 * samples.length) / sampleRate });
        return;
      }
      this.queue.push({ id: m.id, samples, offset: 0 });
      this.queued += samples.length;
    } else if (m.type === "sync") { // messages are handled in order: every push before this one is queued
      this.port.postMessage({ type: "synced", token: m.token });
    } else if (m.type === "clear") {
      const answer = { type: "cleared", id: this.current, playedMs: (1000 * this.played) / sampleRate,
                       droppedMs: (1000 * this.queued) / sampleRate };
      this.reset();
      this.port.postMessage(answer);
    }
  }

  process(_inputs, outputs) {
    const out = outputs[0];
    const n = out[0].length;
    let i = 0;
    while (i < n && this.queue.length > 0) {
      const head = this.queue[0];
      if (head.id !== this.current) {
        this.current = head.id;
        this.played = 0;
      }
      if (!this.playing || this.played === 0) {
        if (this.played === 0) this.port.postMessage({ type: "started", id: head.id });
        this.playing = true;
      }
      const take = Math.min(n - i, head.samples.length - head.offset);
      for (const ch of out) ch.set(head.samples.subarray(head.offset, head.offset + take), i);
      head.offset += take;
      this.played += take;
      this.queued -= take;
      i += take;
      if (head.offset === head.samples.length) this.queue.shift();
    }
    if (i < n && this.playing) { // ran dry: the rest of this quantum is silence (outputs start zeroed)
      this.playing = false;
      this.port.postMessage({ type: "idle", id: this.current, playedMs: (1000 * this.played) / sampleRate });
    }
    return true;
  }
}

registerProcessor("player", Player);
