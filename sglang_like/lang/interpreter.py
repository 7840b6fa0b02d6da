"""SGLang's `sglang.lang.interpreter` names: ProgramState, ProgramStateGroup, StreamExecutor."""

from frontend_dsl.interpreter import StreamExecutor
from frontend_dsl.state import ProgramState, ProgramStateGroup

__all__ = ["ProgramState", "ProgramStateGroup", "StreamExecutor"]
