"""pipecat's OpenAIRealtimeLLMService (its strict event parser) completes a spoken turn against /v1/realtime:
pointed at the server by its base_url, driven by a minimal pipeline (no transport) that feeds it synthesised speech
as InputAudioRawFrames at real-time pace and collects what it pushes."""

from __future__ import annotations

import asyncio

import pytest
from serving import serve
from test_realtime_audio import FRAME, QUESTION, RATE, spoken

from streamserve.config import ServerConfig


@pytest.mark.asyncio
async def test_pipecat_realtime_service_completes_a_spoken_turn(voiced: None) -> None:
    pytest.importorskip("pipecat.services.openai.realtime.llm", reason="pipecat-ai[openai] is a dev dependency")
    from pipecat.frames.frames import (
        EndFrame,
        ErrorFrame,
        Frame,
        InputAudioRawFrame,
        LLMFullResponseEndFrame,
        TranscriptionFrame,
        TTSAudioRawFrame,
    )
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineWorker
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
    from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
    from pipecat.workers.runner import WorkerRunner

    seen: list[Frame] = []
    finished = asyncio.Event()

    class Collect(FrameProcessor):
        async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
            await super().process_frame(frame, direction)
            if isinstance(frame, (TTSAudioRawFrame, TranscriptionFrame, ErrorFrame, LLMFullResponseEndFrame)):
                seen.append(frame)
            if isinstance(frame, ErrorFrame) or (isinstance(frame, LLMFullResponseEndFrame)
                                                 and any(isinstance(f, TTSAudioRawFrame) for f in seen)):
                finished.set()
            await self.push_frame(frame, direction)

    data = spoken(QUESTION)
    async with serve(ServerConfig(), voice=True) as srv:
        llm = OpenAIRealtimeLLMService(api_key="unused", base_url=f"ws://127.0.0.1:{srv.port}/v1/realtime",
                                       settings=OpenAIRealtimeLLMService.Settings(model="default"))
        task = PipelineWorker(Pipeline([Collect(), llm, Collect()]), idle_timeout_secs=None)
        workers = WorkerRunner(handle_sigint=False)
        await workers.add_workers(task)
        runner = asyncio.create_task(workers.run())
        for i in range(0, len(data), FRAME):  # 20 ms frames at real-time pace
            await task.queue_frame(InputAudioRawFrame(audio=data[i:i + FRAME], sample_rate=RATE, num_channels=1))
            await asyncio.sleep(0.02)
        await asyncio.wait_for(finished.wait(), 120)
        await task.queue_frame(EndFrame())
        await asyncio.wait_for(runner, 60)
    errors = [f for f in seen if isinstance(f, ErrorFrame)]
    assert not errors, errors
    transcripts = [f.text for f in seen if isinstance(f, TranscriptionFrame)]
    assert any("capital" in t.lower() for t in transcripts), transcripts
    assert sum(len(f.audio) for f in seen if isinstance(f, TTSAudioRawFrame)) > RATE // 5
