"""An agent framework end to end through codebroker, without a model: smolagents' CodeAgent with
its E2B executor, driven by a scripted model. The agent's code action runs in a codebroker
sandbox, and its final answer comes back through E2B's protocol."""

from smolagents import CodeAgent
from smolagents.models import ChatMessage, MessageRole, Model


class ScriptedModel(Model):
    """Answers with the next of `steps` (what a model would write), and keeps the messages."""

    def __init__(self, steps):
        super().__init__(model_id="scripted")
        self.steps = list(steps)
        self.seen = []

    def generate(self, messages, stop_sequences=None, response_format=None, tools_to_call_from=None, **kwargs):
        self.seen.append(messages)
        return ChatMessage(role=MessageRole.ASSISTANT, content=self.steps.pop(0))


def test_smolagents_code_agent_runs_its_code_in_codebroker(broker):
    model = ScriptedModel([
        "Thought: I compute it in the sandbox and look at where I am.\n"
        "<code>\n"
        "import os, socket\n"
        "total = sum(i * i for i in range(10))\n"
        "print('host', socket.gethostname(), 'cwd', os.getcwd())\n"
        "</code>",
        "Thought: the value is kept between steps.\n"
        "<code>\n"
        "final_answer(total + 1)\n"
        "</code>",
    ])
    agent = CodeAgent(tools=[], model=model, executor_type="e2b", max_steps=4)
    try:
        answer = agent.run("What is the sum of squares below 10, plus one?")
    finally:
        agent.cleanup()
    assert answer == 286
    # The first step's observation came from the sandbox: its working directory is the
    # workspace, and the printed line reached the agent's memory.
    observations = [
        step.observations for step in agent.memory.steps if getattr(step, "observations", None)
    ]
    assert any("cwd /mnt/data" in o for o in observations), observations
