"""The Gluon kernel family for Hopper (sm_90): a warp-specialized FlashAttention forward (FlashAttention-3's
structure) written in Gluon, Triton's lower-level dialect: templates/gluon/ rendered (codegen), launched with
TMA descriptors (launch, whose plan runs the Triton family's backward after it), compiled offline for the CPU
tests (offline), and the family's entry in the registry (family).
It imports from fatune.kernel's shared modules and the Triton family (its backward), fatune.settings,
fatune.hardware and fatune.logs.
"""
