"""A verifiers 0.4 tool environment written with verifiers' API alone: the model may call ``add``; the
episode stops once it answered, and the answer is scored."""

import verifiers.v1 as vf

__all__ = ["CalcTaskset"]


class Calculator(vf.Toolset):
    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class CalcData(vf.TaskData):
    answer: str


class CalcTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Calculator(vf.ToolsetConfig())]

    @vf.stop
    def said_done(self, trace: vf.Trace) -> bool:
        return "DONE" in trace.last_reply

    @vf.reward(weight=1.0)
    async def correct(self, task: CalcData, trace: vf.Trace) -> float:
        return float(task.answer in trace.last_reply)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    def load(self):
        for a, b in [(12, 30), (25, 17), (40, 41), (11, 22), (33, 44)] * 4:
            yield CalcTask(CalcData(prompt=f"Use the add tool: what is {a}+{b}?", answer=str(a + b)))
