"""The kernels: what a call computes, and how the code that computes it is made and launched.

spec (KernelSpec, launch configs), problem (a validated call), layout (output layouts, int32 offsets), codegen
(rendering a family's templates into imported modules), family (the registry of kernel families; the Triton
family is fatune.kernel.triton), interpreter (Triton's CPU interpreter made to compute as a GPU does),
mask_spans (which tiles a mask tensor leaves visible), reference (the dense torch semantics), direct_launch.
It imports only fatune.settings, fatune.hardware and fatune.logs from the rest of fatune.
"""
