// The page's audio graph (one AudioContext for both transports):
//
//   microphone -> "capture" worklet (20 ms levels: the mic meter and the page's own voice activity; with the
//                 WebSocket fallback also 24 kHz PCM16 frames to send)
//   reply audio -> AnalyserNode (the output meter; its RMS is what the page reports as "reply audio heard")
//                  WebSocket: "player" worklet -> analyser -> speakers
//                  WebRTC:    the remote track plays through an <audio> element; a MediaStreamSource of the same
//                             track feeds the analyser (not the speakers: the element plays it)
//
// The page's voice activity (for the latency meter) is a level gate: a 20 ms frame is voiced when its RMS is above
// max(VOICED_FLOOR, 4 x the noise floor), the noise floor being a slow average of the quiet frames.

const VOICED_FLOOR = 0.01; // RMS of a 20 ms frame, full scale 1.0 (about -40 dBFS)
export const HEARD_RMS = 0.003; // output RMS above this counts as reply audio (silence is ~0 in both transports)

export class AudioGraph {
  /** @param {(frame: {rms: number, voiced: boolean}) => void} onLevel */
  constructor(onLevel) {
    this.onLevel = onLevel;
    this.ctx = null;
    this.capture = null;
    this.player = null;
    this.analyser = null;
    this.sources = [];
    this.noise = 0.002;
    this.lastVoicedAt = 0; // performance.now() of the last voiced mic frame
  }

  /** Start the context (inside the click that started the call: autoplay rules) and load the worklets. */
  async open() {
    this.ctx = new AudioContext({ latencyHint: "interactive" });
    await this.ctx.audioWorklet.addModule(new URL("./worklets/capture.js", import.meta.url));
    await this.ctx.audioWorklet.addModule(new URL("./worklets/player.js", import.meta.url));
    if (this.ctx.state !== "running") await this.ctx.resume();
    this.analyser = new AnalyserNode(this.ctx, { fftSize: 1024, smoothingTimeConstant: 0 });
    this.buffer = new Float32Array(this.analyser.fftSize);
  }

  /** The microphone stream -> levels; `send(Int16Array)` receives 24 kHz PCM16 20 ms frames when given. */
  attachMic(stream, send = null) {
    const source = this.ctx.createMediaStreamSource(stream);
    this.capture = new AudioWorkletNode(this.ctx, "capture", {
      numberOfInputs: 1, numberOfOutputs: 0, channelCount: 1, channelCountMode: "explicit",
      processorOptions: { send: Boolean(send) },
    });
    this.capture.port.onmessage = (e) => {
      const m = e.data;
      if (m.type === "pcm" && send) send(m.pcm);
      else if (m.type === "level") this.level(m.rms);
    };
    source.connect(this.capture);
    this.sources.push(source);
  }

  level(rms) {
    const voiced = rms > Math.max(VOICED_FLOOR, 4 * this.noise);
    if (voiced) this.lastVoicedAt = performance.now();
    else this.noise = 0.98 * this.noise + 0.02 * rms; // follows the room, not the voice
    this.onLevel({ rms, voiced });
  }

  /** The WebSocket fallback's player (worklet) -> analyser -> speakers; `onMessage` gets the player's reports. */
  attachPlayer(onMessage) {
    this.player = new AudioWorkletNode(this.ctx, "player", { numberOfInputs: 0, outputChannelCount: [1] });
    this.player.port.onmessage = (e) => onMessage(e.data);
    this.player.connect(this.analyser);
    this.analyser.connect(this.ctx.destination);
  }

  /** WebRTC: the remote audio stream -> analyser only (an <audio> element plays it). */
  attachRemote(stream) {
    const source = this.ctx.createMediaStreamSource(stream);
    source.connect(this.analyser);
    this.sources.push(source);
  }

  /** The reply audio's RMS over the analyser's last ~21 ms (1024 samples at 48 kHz). */
  outputRms() {
    if (!this.analyser) return 0;
    this.analyser.getFloatTimeDomainData(this.buffer);
    let s = 0;
    for (const v of this.buffer) s += v * v;
    return Math.sqrt(s / this.buffer.length);
  }

  /** How long the context holds audio before the speakers (played != heard), ms. */
  outputLatencyMs() {
    return this.ctx ? 1000 * (this.ctx.outputLatency || this.ctx.baseLatency || 0) : 0;
  }

  async close() {
    if (this.capture) this.capture.port.postMessage({ type: "stop" });
    for (const s of this.sources) s.disconnect();
    this.sources = [];
    if (this.ctx) await this.ctx.close().catch(() => {});
    this.ctx = this.capture = this.player = this.analyser = null;
  }
}
