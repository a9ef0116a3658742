"""python -m mini_dist.questions [N ...] [--all] [--markdown]: the questions, each answered by a figure measured now."""
from mini_dist import questions
from mini_dist.kit import launch

if __name__ == "__main__":
    # The ranks unpickle `measure` from mini_dist.questions, imported by name. Without a __spec__ here,
    # multiprocessing prepares them from this file's path instead of re-running `-m mini_dist.questions` as
    # their __main__ (which runpy warns about: the module is already imported by then); the guard keeps a
    # rank that imports this file as its __mp_main__ from asking the questions itself.
    __spec__ = None
    raise SystemExit(launch.main(questions.parser(), questions.demo))
