"""A verifiers 0.4 single-turn environment written with verifiers' API alone: two-digit sums ``a+b=`` (the
prompts the built-in model knows), scored by two weighted rewards."""

import random

import verifiers.v1 as vf

__all__ = ["SumsTaskset"]


class SumsConfig(vf.TasksetConfig):
    size: int = 200
    seed: int = 0
    explode: bool = False  # the `correct` reward raises: how a broken reward function is reported


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    explode = False

    @vf.reward(weight=1.0)
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        if self.explode:
            raise RuntimeError("the grader broke")
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.1)
    async def numeric(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.isdigit())


class SumsTaskset(vf.Taskset[SumTask, SumsConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for _ in range(self.config.size):
            a, b = rng.randint(10, 49), rng.randint(10, 49)
            task = SumTask(SumData(prompt=f"{a}+{b}=", answer=str(a + b)))
            task.explode = self.config.explode
            yield task
