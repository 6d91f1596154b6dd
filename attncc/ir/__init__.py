"""The attncc IR: typed hash-consed nodes, printer, evaluator, simplifier and analyses."""
from .nodes import BOOL, F32, I32, DType, Node
from .program import Bindings, Hook, VariantIR

__all__ = ["BOOL", "F32", "I32", "Bindings", "DType", "Hook", "Node", "VariantIR"]
