// The demo page's controller: Start/Stop, the microphone and camera, the transport (WebRTC first, the /v1/realtime
// WebSocket as the fallback), meters, errors in words. Tests read `window.__demo` (plain data, updated live).
//
// URL options: ?transport=auto|webrtc|ws (default auto), ?camera=1 (camera on at start),
// ?max_output_tokens=N and ?instructions=TEXT (sent in a session.update once connected),
// #key=API_KEY or #token=CLIENT_SECRET (auth.js).

import { AudioGraph, HEARD_RMS } from "./audio.js";
import { Credentials } from "./auth.js";
import { Conversation } from "./conversation.js";
import { WebRtcTransport } from "./rtc-transport.js";
import { WebSocketTransport } from "./ws-transport.js";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const POLL_MS = 20; // output meter / latency / barge-in checks
const SILENT_POLLS = 3; // consecutive quiet polls (60 ms) that count as "playback stopped"

const state = {
  state: "idle", transport: null, fallbackReason: null, session: null, events: {}, userFinal: [], userPartial: "",
  userTyped: [],
  replies: [], latencies: [], latencyDetails: [], bargeIns: [], errors: [], videoNotes: [], playing: false,
  outputRms: 0, outputRmsMax: 0, micRms: 0, micRmsMax: 0, camera: false, droppedMicFrames: 0,
};
window.__demo = state;

const creds = new Credentials((key) => { if (key) $("key").value = key; });
const conv = new Conversation({
  log: $("log"), empty: $("empty"), latency: $("latency"), latencies: $("latencies"), cameraNote: $("camera-note"),
  info: { model: $("info-model"), session: $("info-session"), voice: $("info-voice"), vad: $("info-vad") },
}, state);

conv.send = (ev) => call && call.transport.send(ev);
let call = null; // {graph, transport, mic, cam, poll}
let busy = false;

function setStatus(kind, text) {
  state.state = kind;
  $("text").disabled = $("send").disabled = kind !== "live";
  document.body.dataset.call = kind === "live" || kind === "connecting" ? "on" : "off"; // hides what a call fixes
  const el = $("status");
  el.dataset.state = kind;
  el.textContent = text;
}

function showError(message) {
  if (state.errors[state.errors.length - 1] === message) return; // the same again (e.g. per audio frame): once
  state.errors.push(message);
  const p = document.createElement("p");
  p.textContent = message;
  const box = $("errors");
  box.append(p);
  while (box.children.length > 4) box.firstChild.remove();
}

function meter(bar, rms) {
  const level = Math.max(0, Math.min(1, (20 * Math.log10(rms + 1e-9) + 60) / 60)); // -60..0 dBFS
  bar.style.width = `${(100 * level).toFixed(1)}%`;
  bar.parentElement.setAttribute("aria-valuenow", String(Math.round(100 * level)));
}

function mediaError(e, what) {
  if (!navigator.mediaDevices) {
    return "this browser allows the microphone only on https:// pages or http://localhost: open the page at " +
      "http://127.0.0.1 or http://localhost (e.g. through `ssh -L 8000:127.0.0.1:8000`), or over https";
  }
  if (e.name === "NotAllowedError") return `${what} access was denied: allow it in the site settings, then Start`;
  if (e.name === "NotFoundError") return `no ${what.toLowerCase()} was found`;
  if (e.name === "NotReadableError") return `the ${what.toLowerCase()} is in use by another program`;
  return `${what} failed: ${e.message}`;
}

async function openCamera() {
  const stream = await navigator.mediaDevices.getUserMedia({
    video: { width: { ideal: 640 }, height: { ideal: 480 }, frameRate: { ideal: 15, max: 30 } },
  });
  $("preview").srcObject = stream;
  $("camera-box").hidden = false;
  state.camera = true;
  return stream;
}

function closeCamera(stream) {
  if (stream) for (const t of stream.getTracks()) t.stop();
  $("preview").srcObject = null;
  $("camera-box").hidden = true;
  state.camera = false;
}

function onEvent(ev) {
  const what = conv.handle(ev);
  if (what === "barge-in") bargeIn();
  else if (what === "error") showError(`${ev.error.code || ev.error.type}: ${ev.error.message}`);
  if (ev.type === "output_audio_buffer.started") state.playing = true;
  if (ev.type === "output_audio_buffer.stopped" || ev.type === "output_audio_buffer.cleared") state.playing = false;
}

function onPlayer(m) { // the WebSocket fallback's player worklet
  if (m.type === "started") state.playing = true;
  else if (m.type === "idle" || m.type === "cleared") state.playing = false;
  else if (m.type === "overflow") showError("the reply's audio is longer than the player holds; some was dropped");
}

/** The person spoke: stop the reply's audio at once, whatever the transport; note it for the tests. */
function bargeIn() {
  if (!call) return;
  const wasPlaying = state.playing || state.outputRms > HEARD_RMS;
  call.transport.bargeIn(conv.speaking);
  if (wasPlaying) state.bargeIns.push({ at: performance.now(), stoppedAfterMs: null });
}

function poll() {
  if (!call) return;
  const now = performance.now();
  const rms = call.graph.outputRms();
  state.outputRms = rms;
  state.outputRmsMax = Math.max(state.outputRmsMax, rms);
  meter($("out-bar"), rms);
  if (rms > HEARD_RMS) {
    call.quiet = 0;
    conv.heard(now);
  } else if (++call.quiet === SILENT_POLLS) {
    for (const b of state.bargeIns) if (b.stoppedAfterMs === null) b.stoppedAfterMs = Math.round(now - b.at);
  }
  state.droppedMicFrames = call.transport.dropped || 0;
}

function transportChoice() {
  const forced = params.get("transport");
  return ["auto", "webrtc", "ws"].includes(forced) ? forced : $("transport").value;
}

async function start() {
  if (busy || call) return;
  busy = true;
  $("start").disabled = true;
  $("errors").replaceChildren();
  state.errors = [];
  setStatus("connecting", "Connecting…");
  const c = { graph: null, transport: null, mic: null, cam: null, poll: 0, quiet: 0 };
  try {
    try {
      c.mic = await navigator.mediaDevices.getUserMedia({
        audio: { echoCancellation: true, noiseSuppression: true, autoGainControl: true, channelCount: 1 },
      });
    } catch (e) {
      throw new Error(mediaError(e, "Microphone"));
    }
    if ($("camera").checked) {
      try {
        c.cam = await openCamera();
      } catch (e) {
        showError(mediaError(e, "Camera")); // the call goes on without it
        $("camera").checked = false;
      }
    }
    c.graph = new AudioGraph(({ rms }) => {
      state.micRms = rms;
      state.micRmsMax = Math.max(state.micRmsMax, rms);
      meter($("mic-bar"), rms);
    });
    await c.graph.open();
    conv.lastVoicedAt = () => (c.graph ? c.graph.lastVoicedAt : 0);
    c.transport = await connect(c);
    call = c;
    state.transport = c.transport.name;
    $("info-transport").textContent = c.transport.name === "webrtc" ? "WebRTC" : "WebSocket (/v1/realtime)";
    if (c.cam && c.transport.name !== "webrtc") {
      $("camera-note").textContent = "Preview only: camera frames reach the model over WebRTC, not the WebSocket.";
    }
    if (c.transport.voice === false) {
      showError("this server has no voice: type your messages below. To talk, install the voice extra (pip install " +
        "\"streamserve[voice]\"), pull the voice models (streamserve models pull whisper-base piper-joe " +
        "silero-vad) and restart it");
    }
    c.poll = setInterval(poll, POLL_MS);
    configure(c.transport);
    setStatus("live", c.transport.voice === false ? "Connected — text only" : "Listening — speak");
    $("stop").disabled = false;
    $("stop").focus();
  } catch (e) {
    showError(e.message);
    setStatus("error", "Not connected");
    await teardown(c);
    $("start").disabled = false;
  } finally {
    busy = false;
  }
}

async function connect(c) {
  const choice = transportChoice();
  const handlers = { graph: c.graph, onEvent, onClose: ended, onPlayer, audioEl: $("remote") };
  let credential = await creds.forCall();
  if (choice !== "ws") {
    const rtc = new WebRtcTransport(handlers);
    const camTrack = c.cam ? c.cam.getVideoTracks()[0] : null;
    try {
      await rtc.connect(c.mic, credential, camTrack);
      return rtc;
    } catch (e) {
      rtc.teardown();
      if (choice === "webrtc" || !e.fallback) throw e;
      state.fallbackReason = e.message;
      showError(`${e.message}; using the WebSocket instead`);
      if (creds.key) credential = await creds.forCall(); // a fresh secret: the last may be spent
    }
  }
  const ws = new WebSocketTransport(handlers);
  await ws.connect(c.mic, credential);
  return ws;
}

function configure(transport) {
  const session = { type: "realtime" };
  const max = params.get("max_output_tokens");
  if (max) session.max_output_tokens = max === "inf" ? "inf" : Number(max);
  const instructions = params.get("instructions");
  if (instructions) session.instructions = instructions;
  if (Object.keys(session).length > 1) transport.send({ type: "session.update", session });
}

/** The server or the network ended the call. */
function ended(why) {
  if (why) showError(why);
  stop(why ? "error" : "idle");
}

async function teardown(c) {
  clearInterval(c.poll);
  if (c.transport) await c.transport.close();
  if (c.graph) await c.graph.close();
  for (const s of [c.mic]) if (s) for (const t of s.getTracks()) t.stop();
  closeCamera(c.cam);
}

async function stop(kind = "idle") {
  const c = call;
  call = null;
  if (!c) return;
  $("stop").disabled = true;
  await teardown(c);
  state.playing = false;
  state.transport = null;
  meter($("mic-bar"), 0);
  meter($("out-bar"), 0);
  setStatus(kind, kind === "error" ? "Disconnected" : "Not connected");
  $("start").disabled = false;
  $("start").focus();
}

async function toggleCamera() {
  if (!call) return; // before a call the checkbox only says what Start opens
  if ($("camera").checked) {
    try {
      call.cam = await openCamera();
    } catch (e) {
      showError(mediaError(e, "Camera"));
      $("camera").checked = false;
      return;
    }
  } else {
    closeCamera(call.cam);
    call.cam = null;
  }
  if (call.transport.setCamera) await call.transport.setCamera(call.cam ? call.cam.getVideoTracks()[0] : null);
}

/** A typed message: a user item, then a response (the same events a Realtime client sends). */
function say(e) {
  e.preventDefault();
  const text = $("text").value.trim();
  if (!call || !text) return;
  call.transport.send({ type: "conversation.item.create",
                        item: { type: "message", role: "user", content: [{ type: "input_text", text }] } });
  call.transport.send({ type: "response.create" });
  $("text").value = "";
}

$("start").addEventListener("click", start);
$("say").addEventListener("submit", say);
$("stop").addEventListener("click", () => stop());
$("camera").addEventListener("change", toggleCamera);
$("key").addEventListener("change", (e) => creds.setKey(e.target.value.trim()));
$("key-form").addEventListener("submit", (e) => { // Enter in the key field: keep the key, start the call
  e.preventDefault();
  creds.setKey($("key").value.trim());
  start();
});
if (params.get("camera") === "1") $("camera").checked = true;
if (params.get("transport")) $("transport").value = transportChoice();
window.addEventListener("pagehide", () => stop());
state.ready = true;
