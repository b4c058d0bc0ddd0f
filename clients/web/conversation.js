// The conversation as the page shows it, from the server's events (the same events on both transports): the
// person's words (partial while Whisper streams them, final at the end of the turn), the assistant's streamed
// reply, camera notes, and the latency of each turn. All text goes in with textContent (never parsed as HTML).
//
// Latency of a turn = the first moment the reply's audio is audible in the page (the output analyser's RMS over
// HEARD_RMS) minus the end of the person's speech, which is the last voiced 20 ms microphone frame the page's own
// level gate saw before the server's speech_stopped (audio.js). When the gate saw none (a very quiet microphone),
// the end of speech is taken as speech_stopped's arrival minus the session's silence_duration_ms, and the figure
// says so. Both include the network both ways, the server's VAD hangover, speech to text, the first token, the
// first sentence of speech and the browser's buffering; neither includes the loudspeaker's own latency.

export class Conversation {
  /** @param {{log: HTMLElement, empty: HTMLElement, latency: HTMLElement, latencies: HTMLElement,
   *            info: Record<string, HTMLElement>, cameraNote: HTMLElement}} els  @param {object} state __demo */
  constructor(els, state) {
    this.els = els;
    this.state = state;
    this.entries = new Map(); // item id -> <li>
    this.partials = new Map(); // user item id -> its transcript so far (until .completed)
    this.silenceMs = 500; // session.audio.input.turn_detection.silence_duration_ms
    this.turn = null; // {end, source, serverEnd} between speech_stopped and the first reply audio
    this.speaking = []; // assistant item ids of the running/last response (barge-in targets)
    this.cut = new Set(); // truncated items whose heard text is asked for at the next response.created
  }

  entry(id, role) {
    let li = this.entries.get(id);
    if (!li) {
      li = document.createElement("li");
      li.className = `msg ${role}`;
      const who = document.createElement("span");
      who.className = "who";
      who.textContent = role === "user" ? "You" : role === "assistant" ? "Assistant" : "Camera";
      const text = document.createElement("span");
      text.className = "text";
      li.append(who, text);
      li.setAttribute("aria-busy", "true"); // screen readers read it once it is complete
      this.els.log.append(li);
      this.entries.set(id, li);
      this.els.empty.hidden = true;
      li.scrollIntoView({ block: "nearest" });
    }
    return li;
  }

  setText(id, role, text, done) {
    const li = this.entry(id, role);
    li.querySelector(".text").textContent = text;
    li.classList.toggle("partial", !done);
    if (done) li.setAttribute("aria-busy", "false");
    li.scrollIntoView({ block: "nearest" });
  }

  appendText(id, role, delta) {
    const li = this.entry(id, role);
    const span = li.querySelector(".text");
    span.textContent += delta;
    li.classList.add("partial");
    return span.textContent;
  }

  mark(id, note, keep = false) {
    const li = this.entries.get(id);
    if (!li) return;
    if (keep && li.querySelector(".note")) return; // a truncation's note says more than the response's status
    li.setAttribute("aria-busy", "false");
    li.classList.remove("partial");
    let tag = li.querySelector(".note");
    if (!tag) {
      tag = document.createElement("span");
      tag.className = "note";
      li.append(tag);
    }
    tag.textContent = note;
  }

  /** One server event; returns "barge-in" when the person started speaking (the caller stops playback). */
  handle(ev) {
    const s = this.state;
    s.events[ev.type] = (s.events[ev.type] || 0) + 1;
    switch (ev.type) {
      case "session.created":
      case "session.updated":
        this.session(ev.session);
        break;
      case "input_audio_buffer.speech_started":
        this.turn = null; // spoke again before a reply was heard: that turn has no figure
        this.setText(ev.item_id, "user", "…", false);
        return "barge-in";
      case "input_audio_buffer.speech_stopped":
        this.endOfSpeech();
        break;
      case "conversation.item.input_audio_transcription.delta":
        s.userPartial = (this.partials.get(ev.item_id) || "") + ev.delta;
        this.partials.set(ev.item_id, s.userPartial);
        this.setText(ev.item_id, "user", s.userPartial, false);
        break;
      case "conversation.item.input_audio_transcription.completed":
        s.userPartial = "";
        this.partials.delete(ev.item_id);
        if (ev.transcript.trim()) {
          s.userFinal.push(ev.transcript);
          this.setText(ev.item_id, "user", ev.transcript, true);
        } else {
          this.mark(ev.item_id, "(nothing heard)");
        }
        break;
      case "response.created":
        this.speaking = [];
        for (const id of this.cut) if (this.send) this.send({ type: "conversation.item.retrieve", item_id: id });
        this.cut.clear();
        break;
      case "response.output_item.added":
        if (ev.item && ev.item.role === "assistant") {
          this.speaking.push(ev.item.id);
          s.replies.push({ id: ev.item.id, text: "", status: "in_progress" });
          this.entry(ev.item.id, "assistant");
        }
        break;
      case "response.output_audio_transcript.delta":
      case "response.output_text.delta": {
        const text = this.appendText(ev.item_id, "assistant", ev.delta);
        const reply = s.replies.find((r) => r.id === ev.item_id);
        if (reply) reply.text = text;
        break;
      }
      case "response.done":
        this.responseDone(ev.response);
        break;
      case "conversation.item.truncated":
        this.mark(ev.item_id, "(cut off: you interrupted)");
        this.cut.add(ev.item_id); // retrieved at the next response: the server applies a truncate once the
        break; //                    person's message has ended, and the next response follows that
      case "conversation.item.retrieved":
        this.heardText(ev.item);
        break;
      case "conversation.item.added":
      case "conversation.item.done":
        this.cameraNote(ev.item);
        break;
      case "error":
        return "error";
      default:
        break;
    }
    return null;
  }

  session(session) {
    const s = this.state;
    s.session = { id: session.id, model: session.model };
    const info = this.els.info;
    info.model.textContent = session.model || "—";
    info.session.textContent = session.id || "—";
    const out = (session.audio && session.audio.output) || {};
    const inp = (session.audio && session.audio.input) || {};
    info.voice.textContent = session.output_modalities && session.output_modalities.includes("audio")
      ? (out.voice || "default") : "text only (the server has no voice models)";
    const td = inp.turn_detection;
    if (td) this.silenceMs = td.silence_duration_ms;
    info.vad.textContent = td ? `server VAD, ${td.silence_duration_ms} ms of silence ends a turn` : "no turn detection";
  }

  endOfSpeech() {
    const now = performance.now();
    const serverEnd = now - this.silenceMs;
    const gate = this.lastVoicedAt ? this.lastVoicedAt() : 0;
    // the gate's last voiced frame counts when it falls within this turn (not before the silence began long ago)
    const page = gate > 0 && now - gate < this.silenceMs + 3000;
    this.turn = { end: page ? gate : serverEnd, source: page ? "page" : "server VAD", serverEnd };
  }

  /** The output analyser's reading (every 20 ms): the first audible reply audio after a turn closes it. */
  heard(now) {
    if (!this.turn) return;
    const t = this.turn;
    this.turn = null;
    const ms = Math.round(now - t.end);
    this.state.latencies.push(ms);
    this.state.latencyDetails.push({ ms, source: t.source, serverVadMs: Math.round(now - t.serverEnd) });
    this.els.latency.textContent = `${ms} ms`;
    const li = document.createElement("li");
    li.textContent = `${ms} ms` + (t.source === "page" ? "" : " (from the server's VAD)");
    li.title = `from the server's speech_stopped minus ${this.silenceMs} ms: ${Math.round(now - t.serverEnd)} ms`;
    this.els.latencies.prepend(li);
    while (this.els.latencies.children.length > 8) this.els.latencies.lastChild.remove();
  }

  responseDone(response) {
    for (const item of response.output || []) {
      const reply = this.state.replies.find((r) => r.id === item.id);
      if (reply) reply.status = response.status;
      const note = { cancelled: "(interrupted)", incomplete: "(length limit)", failed: "(failed)" }[response.status];
      this.mark(item.id, note || "", true);
    }
  }

  /** A truncated assistant item, as the server keeps it: the text the person heard replaces the whole reply. */
  heardText(item) {
    if (!item || item.role !== "assistant" || !this.entries.has(item.id)) return;
    const text = (item.content || []).map((c) => c.transcript || c.text || "").join("").trim();
    this.entries.get(item.id).querySelector(".text").textContent = text || "…";
    const reply = this.state.replies.find((r) => r.id === item.id);
    if (reply) reply.heard = text;
  }

  /** A typed user message (input_text; spoken ones are shown from speech_started on), or a system item the
   *  server added for the camera (the vision path's note), shown apart from the dialogue. */
  cameraNote(item) {
    if (!item || !Array.isArray(item.content)) return;
    if (item.role === "user" && item.content.every((c) => c.type === "input_text") && !this.entries.has(item.id)) {
      const text = item.content.map((c) => c.text).join(" ");
      this.state.userTyped.push(text);
      this.setText(item.id, "user", text, true);
      return;
    }
    if (item.role !== "system") return;
    const text = item.content.map((c) => c.text || c.transcript || "").join(" ").trim();
    if (!text || this.entries.has(item.id)) return;
    this.state.videoNotes.push(text);
    this.setText(item.id, "system", text, true);
    this.els.cameraNote.textContent = text;
  }
}
