"""SGLang's `sglang.lang.ir` names: the dtype regexes, the expression classes and GenParams."""

from frontend_dsl.ir import (
    CHOICES_METHODS,
    REGEX_BOOL,
    REGEX_FLOAT,
    REGEX_INT,
    REGEX_STR,
    Concat,
    Expr,
    Gen,
    GenParams,
    RoleBegin,
    RoleEnd,
    Select,
    Text,
    VarScopeBegin,
    VarScopeEnd,
)
from frontend_dsl.program import SglFunction

# SGLang's class names for the same expressions (for isinstance checks in ported code)
SglExpr = Expr
SglGen = Gen
SglSelect = Select
SglConstantText = Text
SglRoleBegin = RoleBegin
SglRoleEnd = RoleEnd
SglVarScopeBegin = VarScopeBegin
SglVarScopeEnd = VarScopeEnd
SglExprList = Concat
SglSamplingParams = GenParams

__all__ = [
    "CHOICES_METHODS", "REGEX_BOOL", "REGEX_FLOAT", "REGEX_INT", "REGEX_STR", "Concat", "Expr",
    "Gen", "GenParams", "RoleBegin", "RoleEnd", "Select", "SglConstantText", "SglExpr",
    "SglExprList", "SglFunction", "SglGen", "SglRoleBegin", "SglRoleEnd", "SglSamplingParams",
    "SglSelect", "SglVarScopeBegin", "SglVarScopeEnd", "Text", "VarScopeBegin", "VarScopeEnd",
]
