// Transport 1: WebRTC, as OpenAI's WebRTC interface. One RTCPeerConnection: the microphone track (and the camera
// track when it is on), a data channel "oai-events" carrying the same events as /v1/realtime (JSON, one per
// message), and the reply's audio as a remote track, played by an <audio> element and analysed by the page.
// The SDP offer (ICE candidates gathered, no trickle) is POSTed to /v1/realtime/calls; the answer comes back with
// 201 and a Location naming the call, which hang-up DELETEs. The server clears its outgoing audio on barge-in and
// truncates what was not played itself; the page mutes the element from speech_started until the next
// output_audio_buffer.started, so what is in the jitter buffer is not heard either.

const GATHER_TIMEOUT_MS = 3000; // ICE gathering on loopback/LAN takes milliseconds; never wait for ever
const CONNECT_TIMEOUT_MS = 15000; // offer posted -> data channel open

export class WebRtcTransport {
  /** @param {{graph: import("./audio.js").AudioGraph, audioEl: HTMLAudioElement, onEvent: Function,
   *            onClose: Function}} o */
  constructor({ graph, audioEl, onEvent, onClose }) {
    this.name = "webrtc";
    this.graph = graph;
    this.audioEl = audioEl;
    this.onEvent = onEvent;
    this.onClose = onClose;
    this.pc = null;
    this.dc = null;
    this.video = null; // the video RTCRtpSender (camera on or off: replaceTrack, no renegotiation)
    this.callUrl = null;
    this.credential = null;
  }

  /** Negotiate the call. Throws an Error whose `fallback` is true when the WebSocket may do instead. */
  async connect(micStream, credential, cameraTrack) {
    if (typeof RTCPeerConnection === "undefined") throw fallbackError("this browser has no WebRTC");
    this.credential = credential;
    const pc = new RTCPeerConnection({ iceServers: [] }); // host candidates: the server is on this network
    this.pc = pc;
    const [mic] = micStream.getAudioTracks();
    pc.addTransceiver(mic, { direction: "sendrecv", streams: [micStream] });
    this.video = pc.addTransceiver(cameraTrack || "video", { direction: "sendonly" }).sender;
    const remote = new Promise((resolve) => {
      pc.ontrack = (e) => {
        if (e.track.kind === "audio") resolve(e.streams[0] || new MediaStream([e.track]));
      };
    });
    const dc = pc.createDataChannel("oai-events");
    this.dc = dc;
    const opened = new Promise((resolve, reject) => {
      dc.onopen = resolve;
      dc.onclose = () => reject(fallbackError("the data channel closed before it opened"));
    });
    dc.onmessage = (e) => {
      let ev;
      try {
        ev = JSON.parse(e.data);
      } catch {
        return;
      }
      if (ev.type === "output_audio_buffer.started") this.audioEl.muted = false;
      this.onEvent(ev);
    };
    await pc.setLocalDescription(await pc.createOffer());
    await gathered(pc);
    const answer = await this.post(pc.localDescription.sdp);
    await pc.setRemoteDescription({ type: "answer", sdp: answer });
    const failed = new Promise((_, reject) => {
      pc.onconnectionstatechange = () => {
        if (pc.connectionState === "failed") reject(fallbackError("the WebRTC connection failed (ICE/DTLS)"));
      };
    });
    let timer = 0;
    const timeout = new Promise((_, reject) => {
      timer = setTimeout(() => reject(fallbackError("the WebRTC connection did not open in time")),
                         CONNECT_TIMEOUT_MS);
    });
    let stream;
    try {
      await Promise.race([opened, failed, timeout]);
      stream = await Promise.race([remote, timeout]);
    } finally {
      clearTimeout(timer);
      failed.catch(() => {}); // settled or abandoned: never an unhandled rejection
      opened.catch(() => {});
    }
    this.audioEl.srcObject = stream;
    await this.audioEl.play().catch(() => {}); // started inside the Start click: allowed
    this.graph.attachRemote(stream);
    this.graph.attachMic(micStream);
    pc.onconnectionstatechange = () => {
      const s = pc.connectionState;
      if (s === "failed" || s === "closed" || s === "disconnected") this.ended(`the WebRTC connection ${s}`);
    };
    dc.onclose = () => this.ended("the server closed the call");
  }

  async post(sdp) {
    const headers = { "Content-Type": "application/sdp" };
    if (this.credential) headers.Authorization = `Bearer ${this.credential}`;
    let res;
    try {
      res = await fetch("/v1/realtime/calls", { method: "POST", body: sdp, headers });
    } catch (e) {
      throw fallbackError(`cannot reach the server (${e.message})`);
    }
    const text = await res.text();
    if (res.status === 201 || res.status === 200) {
      const where = res.headers.get("Location");
      this.callUrl = where ? new URL(where, location.href).href : null;
      return text;
    }
    if (res.status === 401) {
      throw new Error("this server needs an API key: type it into \"API key\", or open the page as /#key=YOUR_KEY");
    }
    let why = `HTTP ${res.status}`;
    try {
      const body = JSON.parse(text);
      why = (body.error && body.error.message) || body.message || why;
    } catch {
      /* not JSON: keep the status */
    }
    // 404/405/501: a server without WebRTC (no aiortc); 503: busy. The WebSocket may still serve.
    throw fallbackError(`the server did not take the WebRTC call: ${why}`, res.status !== 403 && res.status !== 429);
  }

  /** Camera on (a track) or off (null) during the call. */
  async setCamera(track) {
    if (this.video) await this.video.replaceTrack(track);
  }

  bargeIn() {
    this.audioEl.muted = true; // the server clears its track; this silences what is already on its way
  }

  send(ev) {
    if (this.dc && this.dc.readyState === "open") this.dc.send(JSON.stringify(ev));
  }

  ended(why) {
    if (!this.pc) return;
    this.teardown();
    this.onClose(why);
  }

  teardown() {
    const { pc, dc } = this;
    this.pc = this.dc = null;
    if (dc) {
      dc.onclose = null;
      dc.close();
    }
    if (pc) {
      pc.onconnectionstatechange = null;
      pc.close();
    }
    this.audioEl.srcObject = null;
  }

  async close() {
    const url = this.callUrl;
    this.callUrl = null;
    this.audioEl.srcObject = null; // silent at once
    if (url) {
      const headers = this.credential ? { Authorization: `Bearer ${this.credential}` } : {};
      // hang up before closing the peer: a closed peer ends the call on the server, and a DELETE that came after
      // would find no call (404). keepalive: the request goes out also when the page is closing.
      const hangUp = fetch(url, { method: "DELETE", headers, keepalive: true }).catch(() => {});
      await Promise.race([hangUp, new Promise((resolve) => setTimeout(resolve, 2000))]);
    }
    this.teardown();
  }
}

function fallbackError(message, fallback = true) {
  const e = new Error(message);
  e.fallback = fallback;
  return e;
}

function gathered(pc) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => {
      if (pc.iceGatheringState === "complete") resolve();
    };
    pc.addEventListener("icegatheringstatechange", done);
    setTimeout(resolve, GATHER_TIMEOUT_MS);
  });
}
