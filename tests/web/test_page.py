"""The demo page in real Chromium without the voice models (a text-only server with an API key): the layout at
desktop and phone widths, keyboard order, the resampler the worklets use, errors in words (no key, microphone
denied), a call with the key from the URL fragment (a client secret minted per call), and nothing left on the
server after Stop. Skips when chromium or playwright is missing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from browser import Browser, DemoServer, Namespace, artifacts, chromium, demo
from demo_checks import WAIT

pytestmark = pytest.mark.slow
KEY = "test-key-for-the-page"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoServer]:
    chromium()
    tmp = tmp_path_factory.mktemp("page-server")
    with Namespace.create(required=False) as ns, \
            DemoServer.start(ns, ["--no-voice", "--no-vision"], tmp / "server.log", env={"STREAMSERVE_API_KEY": KEY},
                             port=8001) as srv:
        srv.ns = ns  # type: ignore[attr-defined]
        yield srv


@pytest.fixture
def browser(server: DemoServer, tmp_path: Path) -> Iterator[Browser]:
    with Browser.launch(tmp_path, server.ns) as b:  # type: ignore[attr-defined]
        yield b


def test_layout_and_keyboard_at_desktop_and_phone_width(server: DemoServer, browser: Browser) -> None:
    out = artifacts("page")
    page = browser.new_page(server.url + "/")
    page.screenshot(path=str(out / "desktop.png"), full_page=True)
    order = []
    for _ in range(5):
        page.keyboard.press("Tab")
        order.append(page.evaluate("document.activeElement.id || document.activeElement.tagName"))
    assert order[:4] == ["start", "camera", "transport", "SUMMARY"], order  # Stop is disabled until a call
    assert page.get_attribute("#log", "aria-live") == "polite"
    assert page.get_attribute("#errors", "role") == "alert"
    page.set_viewport_size({"width": 360, "height": 740})
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    box = page.locator("#start").bounding_box()
    assert box is not None and box["height"] >= 44  # a finger-sized target
    page.screenshot(path=str(out / "phone.png"), full_page=True)
    assert not [m for m in browser.console if m.startswith(("pageerror", "error"))], browser.console


def test_the_worklets_resampler_keeps_a_tone_and_drops_what_would_alias(server: DemoServer, browser: Browser) -> None:
    page = browser.new_page(server.url + "/")
    result = page.evaluate("""async () => {
      const { Resampler } = await import('/web/worklets/resampler.js');
      const run = (inRate, outRate, f) => {
        const r = new Resampler(inRate, outRate); const out = []; let n = 0;
        for (let b = 0; b < 300; b++) {            // in 128-sample quanta, as a worklet gets them
          const x = new Float32Array(128);
          for (let i = 0; i < 128; i++, n++) x[i] = 0.5 * Math.sin(2 * Math.PI * f * n / inRate);
          out.push(...r.process(x));
        }
        return { out, n };
      };
      const err = (inRate, outRate) => {
        const { out, n } = run(inRate, outRate, 440); let e = 0;
        for (let i = 1000; i < 2000; i++) e += (out[i] - 0.5 * Math.sin(2 * Math.PI * 440 * i / outRate)) ** 2;
        return { rmse: Math.sqrt(e / 1000), ratio: out.length / (n * outRate / inRate) };
      };
      const alias = run(48000, 24000, 15000).out.slice(1000);   // 15 kHz: above 24 kHz's Nyquist
      const rms = Math.sqrt(alias.reduce((s, v) => s + v * v, 0) / alias.length);
      return { down: err(48000, 24000), odd: err(44100, 24000), up: err(24000, 48000), aliasRms: rms };
    }""")
    for name in ("down", "odd", "up"):
        assert result[name]["rmse"] < 1e-3, result  # a 0.5-amplitude tone, delay-free
        assert 0.99 < result[name]["ratio"] <= 1.0, result  # all the samples come out (less the filter's reach)
    assert result["aliasRms"] < 1e-3, result  # vs 0.35 unfiltered


def test_without_the_key_the_page_says_so_and_a_key_in_the_fragment_connects(server: DemoServer,
                                                                            browser: Browser) -> None:
    page = browser.new_page(server.url + "/?transport=ws")
    page.click("#start")
    page.wait_for_function("() => __demo.state === 'error'", timeout=WAIT)
    assert "needs an API key" in page.text_content("#errors")
    assert page.is_enabled("#start")
    # the key in the fragment: the page mints a client secret with it and the WebSocket carries only that
    page.goto(f"{server.url}/?transport=ws#key={KEY}")
    page.wait_for_function("() => window.__demo && window.__demo.ready")
    assert "#" not in page.url  # the fragment was taken out of the address bar
    page.click("#start")
    page.wait_for_function("() => __demo.session !== null", timeout=WAIT)
    assert demo(page, "transport") == "websocket"
    assert "text only" in page.text_content("#info-voice")
    errors = demo(page, "errors")  # one, in words: what to install (the mic is not sent to a deaf server)
    assert len(errors) == 1 and "has no voice" in errors[0] and "whisper-base" in errors[0], errors
    # typed: a user item and a response, the reply streamed as text (output_text.delta)
    page.fill("#text", "In the beginning")
    page.press("#text", "Enter")
    page.wait_for_function("() => __demo.replies.some(r => r.status === 'completed' || r.status === 'incomplete')",
                           timeout=WAIT)
    assert demo(page, "userTyped") == ["In the beginning"] and "In the beginning" in page.text_content("#log")
    assert demo(page, "replies[0].text").strip() and demo(page, "events['response.output_text.delta']") >= 1
    page.screenshot(path=str(artifacts("page") / "text-only-call.png"))
    page.click("#stop")
    page.wait_for_function("() => __demo.state === 'idle'", timeout=WAIT)
    page.wait_for_function(f"() => fetch('/healthz', {{headers: {{Authorization: 'Bearer {KEY}'}}}})"
                           ".then(r => r.json()).then(h => h.connections === 0 && h.sessions_open === 0)",
                           timeout=WAIT)


def test_a_denied_microphone_is_explained(server: DemoServer, tmp_path: Path) -> None:
    with Browser.launch(tmp_path, server.ns, allow_media=False) as b:  # type: ignore[attr-defined]
        page = b.new_page(server.url + "/?transport=ws")
        page.click("#start")
        page.wait_for_function("() => __demo.state === 'error'", timeout=WAIT)
        assert "Microphone access was denied" in page.text_content("#errors")
        assert demo(page, "transport") is None and page.is_enabled("#start")


def test_a_browser_without_webrtc_falls_back_to_the_websocket(server: DemoServer, browser: Browser) -> None:
    browser.context.add_init_script("delete window.RTCPeerConnection;")  # as a browser without WebRTC
    page = browser.new_page(f"{server.url}/?transport=auto#key={KEY}")
    page.click("#start")
    page.wait_for_function("() => __demo.session !== null", timeout=WAIT)
    assert demo(page, "transport") == "websocket"
    assert "no WebRTC" in demo(page, "fallbackReason")
    assert "using the WebSocket instead" in page.text_content("#errors")
    assert page.text_content("#info-transport") == "WebSocket (/v1/realtime)"
    page.click("#stop")
    page.wait_for_function("() => __demo.state === 'idle'", timeout=WAIT)


def test_the_player_worklet_plays_gaplessly_and_stops_at_once_on_clear(server: DemoServer, browser: Browser) -> None:
    """The WebSocket path's loudspeaker, rendered offline: two deltas of a 24 kHz tone play as one (resampled to
    48 kHz), a "clear" (barge-in) silences the output from the next render quantum and reports what was played."""
    page = browser.new_page(server.url + "/")
    r = page.evaluate("""async () => {
      const rate = 48000, ctx = new OfflineAudioContext(1, rate, rate);       // one second
      await ctx.audioWorklet.addModule('/web/worklets/player.js');
      const node = new AudioWorkletNode(ctx, 'player', { numberOfInputs: 0, outputChannelCount: [1] });
      node.connect(ctx.destination);
      const msgs = [], waiting = {};
      node.port.onmessage = (e) => { msgs.push(e.data); if (waiting[e.data.type]) waiting[e.data.type](); };
      const answer = (type) => new Promise((ok) => { waiting[type] = ok; });  // the render waits for the worklet
      const tone = (from, n) => Int16Array.from({ length: n },
                                                (_, i) => 16000 * Math.sin(2 * Math.PI * 440 * (from + i) / 24000));
      ctx.suspend(0).then(async () => {        // before the first quantum: 0.8 s of audio in two deltas
        node.port.postMessage({ type: 'push', id: 'item_a', pcm: tone(0, 9600) });
        node.port.postMessage({ type: 'push', id: 'item_a', pcm: tone(9600, 9600) });
        node.port.postMessage({ type: 'sync', token: 1 });
        await answer('synced');
        ctx.resume();
      });
      ctx.suspend(0.4).then(async () => {      // the person speaks at 0.4 s
        node.port.postMessage({ type: 'clear' });
        await answer('cleared');
        ctx.resume();
      });
      const out = (await ctx.startRendering()).getChannelData(0);
      await new Promise((ok) => setTimeout(ok, 50));                          // the last messages arrive
      const cleared = msgs.find((m) => m.type === 'cleared');
      const end = Math.round(cleared.playedMs * rate / 1000);                 // the samples played before the clear
      const rms = (a) => Math.sqrt(a.reduce((s, v) => s + v * v, 0) / Math.max(1, a.length));
      let jump = 0;                                                           // the largest step: a gap would show
      for (let i = 4800; i < end - 1; i++) jump = Math.max(jump, Math.abs(out[i + 1] - out[i]));
      return { types: msgs.map((m) => m.type), cleared, end, before: rms(out.slice(2000, end)),
               afterPeak: Math.max(...out.slice(end).map(Math.abs)), jump };
    }""")
    assert r["types"] == ["synced", "started", "cleared"], r  # no "idle": the deltas played as one
    assert r["cleared"]["id"] == "item_a" and r["cleared"]["playedMs"] == 400, r  # cleared where asked
    assert r["cleared"]["droppedMs"] > 300, r  # the rest of the 0.8 s was dropped, not played
    assert 0.3 < r["before"] < 0.4, r  # the tone, 16000/32768 x 1/sqrt(2) ~ 0.345, resampled intact
    assert r["jump"] < 0.06, r  # no gap between the two deltas (a 440 Hz tone moves ~0.028 a sample at 48 kHz)
    assert r["afterPeak"] == 0.0, r  # silent from the clear on


def test_the_capture_worklet_sends_20ms_pcm16_frames_at_24khz(server: DemoServer, browser: Browser) -> None:
    """The WebSocket path's microphone, rendered offline at 48 kHz: a 440 Hz tone comes out as 480-sample (20 ms)
    PCM16 frames of the same tone at 24 kHz, with a level report per 20 ms."""
    page = browser.new_page(server.url + "/")
    r = page.evaluate("""async () => {
      const rate = 48000, ctx = new OfflineAudioContext(1, rate, rate);       // one second of input
      await ctx.audioWorklet.addModule('/web/worklets/capture.js');
      const node = new AudioWorkletNode(ctx, 'capture', { numberOfInputs: 1, numberOfOutputs: 0,
                                                         processorOptions: { send: true } });
      const osc = new OscillatorNode(ctx, { frequency: 440 });
      const gain = new GainNode(ctx, { gain: 0.5 });
      osc.connect(gain).connect(node);
      osc.start();
      const frames = [], levels = [];
      node.port.onmessage = (e) => (e.data.type === 'pcm' ? frames : levels).push(e.data);
      await ctx.startRendering();
      for (let i = 0; i < 200 && levels.length < 50; i++) await new Promise((ok) => setTimeout(ok, 10));
      const pcm = new Int16Array(frames.length * 480);
      frames.forEach((f, i) => pcm.set(f.pcm, i * 480));
      let best = 1e9;                                                         // the tone at 24 kHz, any phase
      for (let lag = 0; lag < 55; lag++) {
        let e = 0;
        for (let i = 2400; i < 7200; i++) {
          e += (pcm[i] / 32768 - 0.5 * Math.sin(2 * Math.PI * 440 * (i - lag) / 24000)) ** 2;
        }
        best = Math.min(best, Math.sqrt(e / 4800));
      }
      return { frames: frames.length, sizes: [...new Set(frames.map((f) => f.pcm.length))], levels: levels.length,
               level: levels[25].rms, rmse: best };
    }""")
    assert r["sizes"] == [480] and 48 <= r["frames"] <= 50, r  # 20 ms frames: ~1 s less the filter's reach
    assert r["levels"] == 50 and abs(r["level"] - 0.5 / 2 ** 0.5) < 0.01, r  # one level per 20 ms, the tone's RMS
    assert r["rmse"] < 2e-3, r  # the same tone (PCM16 rounding and the resampler's ripple only)
