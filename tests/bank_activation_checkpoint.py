"""Activation checkpointing: the exercise's bank (kit/exercise.py); MISTAKES: tests/test_activation_checkpoint.py."""
from mini_dist.kit import exercise
from mini_dist.kit.exercise import planted

HINTS = {
    "ReentrantCheckpoint.forward": [
        "backward(ctx, grad) is given only ctx and the gradient: whatever it needs to run fn again, exactly as "
        "forward ran it, travels on ctx. Which tensors does it need, and what else decides what fn computes "
        "(think of dropout)?",
        "fn itself; the inputs, kept the way autograd keeps tensors (ctx.save_for_backward); and the RNG state "
        "from before fn runs, so that dropout can draw the same masks again: rng_state(inputs).",
        "ctx.fn = fn, ctx.rng = rng_state(inputs), ctx.save_for_backward(*inputs), then return fn(*inputs): a "
        "Function's forward runs without grad, so fn saves nothing.",
    ],
    "ReentrantCheckpoint.backward": [
        "Forward kept no activations, so backward makes them again: fn on the kept inputs (ctx.saved_tensors), as "
        "forward ran it, with the same dropout masks, and this time with a graph to backpropagate grad through.",
        "Detach each kept input into a leaf with the input's requires_grad; run ctx.fn on the leaves inside "
        "replayed_rng(ctx.rng) and torch.enable_grad() (a Function's backward runs with grad off); "
        "torch.autograd.backward(output, grad) then fills the weights' .grad and the leaves' .grad.",
        "Return None (for fn), then each leaf's .grad, in the order of the inputs.",
    ],
}

OWN = exercise.answers("activation_checkpoint")  # mini_dist's code, kept by a wrong solution where it is not wrong

RIGHT = {
    "forward under an explicit no_grad; backward with set_grad_enabled and output.backward": {
        "ReentrantCheckpoint.forward": """
            ctx.save_for_backward(*inputs)
            ctx.rng = rng_state(inputs)
            ctx.fn = fn
            with torch.no_grad():
                return fn(*inputs)
        """,
        "ReentrantCheckpoint.backward": """
            leaves = []
            for x in ctx.saved_tensors:
                leaf = x.detach()
                leaf.requires_grad = x.requires_grad
                leaves.append(leaf)
            with torch.set_grad_enabled(True), replayed_rng(ctx.rng):
                output = ctx.fn(*leaves)
            output.backward(grad)
            return (None,) + tuple(leaf.grad for leaf in leaves)
        """,
    },
    "the random state replayed outside the graph's recording, gradients read per input": {
        "ReentrantCheckpoint.forward": """
            ctx.state = rng_state(inputs)
            ctx.function = fn
            ctx.save_for_backward(*inputs)
            return fn(*inputs)
        """,
        "ReentrantCheckpoint.backward": """
            detached = tuple(x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors)
            with replayed_rng(ctx.state):
                with torch.enable_grad():
                    output = ctx.function(*detached)
            torch.autograd.backward([output], [grad])
            return None, *[x.grad if x.requires_grad else None for x in detached]
        """,
    },
}

FORWARD = OWN["ReentrantCheckpoint.forward"]
BACKWARD = OWN["ReentrantCheckpoint.backward"]
# the lines of BACKWARD the wrong solutions below plant their mistakes in
DETACHED = "inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]"
RERUN = "with replayed_rng(ctx.rng), torch.enable_grad():"
RETURNED = "return None, *(x.grad for x in inputs)"

WRONG = {
    "the rerun outside replayed_rng: dropout draws new masks": ("dropout's randomness not replayed", {
        "ReentrantCheckpoint.forward": FORWARD,
        "ReentrantCheckpoint.backward": planted(BACKWARD, {RERUN: "with torch.enable_grad():"}),
    }),
    "the RNG state taken after fn has drawn forward's masks": ("dropout's randomness not replayed", {
        "ReentrantCheckpoint.forward": planted(FORWARD, {
            "ctx.rng = rng_state(inputs)": "",
            "return fn(*inputs)": "output = fn(*inputs)\nctx.rng = rng_state(inputs)\nreturn output"}),
        "ReentrantCheckpoint.backward": BACKWARD,
    }),
    "the rerun under backward's own grad mode (off)": ("recomputed without grad", {
        "ReentrantCheckpoint.forward": FORWARD,
        "ReentrantCheckpoint.backward": planted(BACKWARD, {RERUN: "with replayed_rng(ctx.rng):"}),
    }),
    "None returned for every input: the gradients left on the detached copies": ("inputs' gradients not returned", {
        "ReentrantCheckpoint.forward": FORWARD,
        "ReentrantCheckpoint.backward": planted(BACKWARD, {RETURNED: "return (None,) * (1 + len(inputs))"}),
    }),
    "the rerun on the inputs themselves, None returned: the input's .grad written only as a side effect": (
        "inputs' gradients not returned", {
            "ReentrantCheckpoint.forward": FORWARD,
            "ReentrantCheckpoint.backward": planted(BACKWARD, {
                DETACHED: "inputs = ctx.saved_tensors",
                RETURNED: "return None, *(None for x in inputs)"}),
        }),
    "the inputs' gradients returned without fn's None": ("not one gradient per forward argument", {
        "ReentrantCheckpoint.forward": FORWARD,
        "ReentrantCheckpoint.backward": planted(BACKWARD, {RETURNED: "return tuple(x.grad for x in inputs)"}),
    }),
    "forward runs fn with grad on: its activations saved as without checkpointing": ("whole activation kept", {
        "ReentrantCheckpoint.forward": planted(FORWARD, {
            "return fn(*inputs)": "with torch.enable_grad():\n    return fn(*inputs)"}),
        "ReentrantCheckpoint.backward": BACKWARD,
    }),
    "the rerun on ctx.saved_tensors themselves: each input's gradient counted twice": (
        "rerun on the inputs themselves, not detached copies", {
            "ReentrantCheckpoint.forward": FORWARD,
            "ReentrantCheckpoint.backward": planted(BACKWARD, {DETACHED: "inputs = ctx.saved_tensors"}),
        }),
    "torch.autograd.grad for the inputs alone: the weights' .grad never written": ("weights' .grad not accumulated", {
        "ReentrantCheckpoint.forward": FORWARD,
        "ReentrantCheckpoint.backward": planted(BACKWARD, {
            "torch.autograd.backward(output, grad)": "",
            RETURNED: "return None, *torch.autograd.grad(output, inputs, grad)"}),
    }),
    "the inputs put on ctx as an attribute, out of autograd's sight": ("inputs kept beside autograd", {
        "ReentrantCheckpoint.forward": planted(FORWARD, {"ctx.save_for_backward(*inputs)": "ctx.inputs = inputs"}),
        "ReentrantCheckpoint.backward": planted(BACKWARD, {
            DETACHED: "inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.inputs]"}),
    }),
}
