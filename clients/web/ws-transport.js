// Transport 2, the fallback: the /v1/realtime WebSocket. The microphone goes up as input_audio_buffer.append
// events (PCM16 mono 24 kHz, base64, one per 20 ms frame from the capture worklet); the reply's
// response.output_audio.delta audio is played by the player worklet. On barge-in the player is cleared at once
// and the interrupted item is truncated to what was played (conversation.item.truncate), so the conversation
// keeps only what the person heard. A socket that stops draining does not buffer for ever: past MAX_BUFFERED
// bytes mic frames are dropped (and counted).

const MAX_BUFFERED = 1 << 20; // bytes the browser may hold unsent before mic frames are dropped

export function base64OfBytes(bytes) {
  let s = "";
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  return btoa(s);
}

export function pcm16OfBase64(b64) {
  const bin = atob(b64);
  const bytes = new Uint8Array(bin.length & ~1);
  for (let i = 0; i < bytes.length; i++) bytes[i] = bin.charCodeAt(i);
  return new Int16Array(bytes.buffer); // little-endian, as every browser platform is
}

export class WebSocketTransport {
  /** @param {{graph: import("./audio.js").AudioGraph, onEvent: Function, onClose: Function, onPlayer: Function}} o */
  constructor({ graph, onEvent, onClose, onPlayer }) {
    this.name = "websocket";
    this.graph = graph;
    this.onEvent = onEvent;
    this.onClose = onClose;
    this.onPlayer = onPlayer;
    this.ws = null;
    this.dropped = 0; // mic frames dropped because the socket was backed up
    this.silenced = new Set(); // interrupted items: their late deltas are not played
    this.truncated = new Set();
    this.running = new Set(); // items of responses not yet done
    this.pendingTruncates = new Map(); // item id -> ms heard, sent once its response is done
  }

  /** Open the socket with `credential` (or none), start sending the mic. Throws a user-facing Error. */
  async connect(micStream, credential) {
    const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/v1/realtime`;
    const protocols = ["realtime"];
    if (credential) protocols.push(`openai-insecure-api-key.${credential}`);
    const ws = new WebSocket(url, protocols);
    this.ws = ws;
    await new Promise((resolve, reject) => {
      ws.onopen = resolve;
      ws.onclose = (e) => reject(e);
    }).catch(async (e) => {
      throw new Error(await explainRefusal(e, credential));
    });
    let greeted;
    const greeting = new Promise((resolve) => { greeted = resolve; });
    ws.onmessage = (e) => {
      let ev;
      try {
        ev = JSON.parse(e.data);
      } catch {
        return;
      }
      if (ev.type === "session.created") greeted(ev.session);
      else if (ev.type === "response.output_audio.delta") this.play(ev);
      else if (ev.type === "response.output_item.added" && ev.item) this.running.add(ev.item.id);
      else if (ev.type === "response.done") this.responseDone(ev.response);
      this.onEvent(ev);
    };
    const closed = new Promise((_, reject) => {
      ws.onclose = (e) => {
        this.ws = null;
        reject(new Error(closeText(e)));
        this.onClose(e.code === 1000 || e.code === 1005 ? null : closeText(e));
      };
    });
    // the session says whether the server listens (voice models): without them the mic is metered, not sent
    const session = await Promise.race([greeting, closed]);
    this.voice = Boolean(session.audio && session.audio.input && session.audio.input.turn_detection) ||
      (session.output_modalities || []).includes("audio");
    this.graph.attachPlayer((m) => {
      if (m.type === "cleared" && m.id && m.playedMs > 0) this.truncate(m.id, m.playedMs);
      this.onPlayer(m);
    });
    this.graph.attachMic(micStream, this.voice ? (pcm) => this.sendAudio(pcm) : null);
  }

  sendAudio(pcm) {
    if (!this.ws || this.ws.readyState !== WebSocket.OPEN) return;
    if (this.ws.bufferedAmount > MAX_BUFFERED) {
      this.dropped++;
      return;
    }
    this.send({ type: "input_audio_buffer.append", audio: base64OfBytes(new Uint8Array(pcm.buffer)) });
  }

  play(ev) {
    if (this.silenced.has(ev.item_id) || !this.graph.player) return;
    const pcm = pcm16OfBase64(ev.delta);
    this.graph.player.port.postMessage({ type: "push", id: ev.item_id, pcm }, [pcm.buffer]);
  }

  /** The person started speaking: stop the reply's audio now (its late deltas too); the player answers "cleared"
   *  with what it had played, and that item is truncated there. */
  bargeIn(itemIds) {
    for (const id of itemIds) this.silenced.add(id);
    if (this.graph.player) this.graph.player.port.postMessage({ type: "clear" });
  }

  /** Cut `itemId` to what was heard. The server truncates an item once its response has ended (the barge-in
   *  cancels it within an engine step): until response.done the truncate waits here. */
  truncate(itemId, playedMs) {
    if (this.truncated.has(itemId)) return;
    this.truncated.add(itemId);
    const heard = Math.max(0, Math.floor(playedMs - this.graph.outputLatencyMs()));
    if (this.running.has(itemId)) this.pendingTruncates.set(itemId, heard);
    else this.send({ type: "conversation.item.truncate", item_id: itemId, content_index: 0, audio_end_ms: heard });
  }

  responseDone(response) {
    for (const item of (response && response.output) || []) {
      this.running.delete(item.id);
      const heard = this.pendingTruncates.get(item.id);
      if (heard === undefined) continue;
      this.pendingTruncates.delete(item.id);
      this.send({ type: "conversation.item.truncate", item_id: item.id, content_index: 0, audio_end_ms: heard });
    }
  }

  send(ev) {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify(ev));
  }

  async close() {
    if (this.ws) {
      const ws = this.ws;
      this.ws = null;
      ws.onclose = null;
      ws.close(1000, "bye");
    }
  }
}

function closeText(e) {
  const reason = e.reason ? `: ${e.reason}` : "";
  if (e.code === 1013) return `the server is busy or still loading the model${reason}; try again shortly`;
  if (e.code === 1001) return `the server is shutting down${reason}`;
  if (e.code === 1006) return "the connection to the server was lost";
  return `the server closed the connection (${e.code}${reason})`;
}

/** A WebSocket that never opened says nothing about why (browsers hide the HTTP answer); ask the same route over
 *  plain HTTP with the same credential: 401 is the key, 403 the origin, no answer a server that is not there. */
async function explainRefusal(closeEvent, credential) {
  if (closeEvent && closeEvent.code && closeEvent.code !== 1006) return closeText(closeEvent);
  try {
    const res = await fetch("/v1/realtime", { headers: credential ? { Authorization: `Bearer ${credential}` } : {} });
    if (res.status === 401) {
      return "this server needs an API key: type it into \"API key\", or open the page as /#key=YOUR_KEY";
    }
    if (res.status === 403) return "this server does not accept pages from this origin (its --allowed-origins)";
    return `the server refused the WebSocket (HTTP ${res.status})`;
  } catch {
    return "cannot reach the server: is `streamserve serve` running?";
  }
}
