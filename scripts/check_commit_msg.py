"""Check commit messages against the project's rules (CONTRIBUTING.md, "Commit messages").

A commit is one logical change, and its subject says what it changes, in the imperative::

    Add the grad_clip plugin: clip the global gradient norm in post_backward

    Optional body, after one blank line: why, and anything a reviewer should know.

    ghstack-source-id: 1b2c...        <- added by `ghstack submit`: accepted
    Pull-Request: https://github.com/<owner>/<repo>/pull/12

`ghstack land` later appends ``(#12)`` to the subject; the rules allow for it.

Usage (from the repository root)::

    python scripts/check_commit_msg.py                      # origin/main..HEAD
    python scripts/check_commit_msg.py main..HEAD HEAD~3..  # any `git log` revision ranges
    python scripts/check_commit_msg.py --pull-request HEAD_REF BASE_SHA..HEAD_SHA   # CI

``--pull-request`` is what CI runs on a pull request. A ghstack pull request's head branch
``gh/<user>/<N>/head`` holds commits that ghstack synthesised ("[ghstack-poisoned]"); the
contributor's commit is the tip of ``gh/<user>/<N>/orig``, so that is the one checked. Any
other pull request has its commits checked. The stack check (``scripts/stack_check.py``)
applies the same rules to every commit of a local stack before anything else.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

SUBJECT_MAX = 72
"""Longest subject, not counting the `` (#N)`` that ``ghstack land`` appends."""

LAND_SUFFIX = re.compile(r" \(#\d+\)$")
"""What ``ghstack land`` appends to a landed commit's subject."""

GHSTACK_TRAILERS = ("ghstack-source-id", "Pull-Request")
"""Trailers ``ghstack submit`` adds, one of each per commit."""

GHSTACK_HEAD_REF = re.compile(r"gh/(?P<user>[^/]+)/(?P<number>\d+)/head")

SCOPE = re.compile(r"(?P<scope>[\w./-]+): ")
"""An optional ``scope: `` prefix naming the area a commit touches (``config: coerce ...``)."""

AUTOSQUASH = ("fixup!", "squash!", "amend!")

WORK_IN_PROGRESS = re.compile(r"[\[(]?wip\b", re.IGNORECASE)
"""A work-in-progress subject in any spelling: ``WIP ...``, ``WIP: ...``, ``[WIP] ...``."""

NULL_SHA = "0" * 40
"""The ``before`` of a push that created its branch: there is no range to check."""

# NOTE: a list, not a suffix rule: "Embed", "Seed", "Bring" and "String" are fine first
# words, so "-ed" and "-ing" cannot be judged by their spelling alone.
NOT_IMPERATIVE = frozenset(
    word
    for forms in (
        "added adds adding",
        "allowed allows allowing",
        "bumped bumps bumping",
        "changed changes changing",
        "cleaned cleans cleaning",
        "created creates creating",
        "deleted deletes deleting",
        "disabled disables disabling",
        "documented documents documenting",
        "enabled enables enabling",
        "fixed fixes fixing",
        "implemented implements implementing",
        "improved improves improving",
        "introduced introduces introducing",
        "made makes making",
        "merged merges merging",
        "moved moves moving",
        "refactored refactors refactoring",
        "removed removes removing",
        "renamed renames renaming",
        "replaced replaces replacing",
        "reverted reverts reverting",
        "tested tests testing",
        "updated updates updating",
        "used uses using",
        "wrote writes writing",
    )
    for word in forms.split()
)
"""First words that are not the imperative: "Added x" / "Adds x" / "Adding x" -> "Add x"."""


def problems(message: str) -> list[str]:
    """Return what is wrong with one commit message, in words; empty if it is fine."""
    lines = message.strip("\n").splitlines()
    if not lines or not lines[0].strip():
        return ["the subject (first line) is empty"]
    subject = LAND_SUFFIX.sub("", lines[0].rstrip())
    if subject.startswith(AUTOSQUASH):
        return [f"'{subject.split()[0]}' commit: squash it first (git rebase -i --autosquash)"]
    found = []
    if subject != subject.lstrip():
        found.append("the subject starts with whitespace")
    if len(subject) > SUBJECT_MAX:
        found.append(f"the subject is {len(subject)} characters long; keep it within {SUBJECT_MAX}")
    if subject.endswith("."):
        found.append("the subject ends with a period")
    scope = SCOPE.match(subject)
    summary = subject[scope.end() :] if scope else subject.lstrip()
    first_word = summary.split()[0] if summary.split() else ""
    # Before the scope and case rules: "WIP: ..." would pass as a scope, and "[WIP] ..." would
    # be reported as a lowercase subject, which misleads.
    if WORK_IN_PROGRESS.match(subject.lstrip()) or WORK_IN_PROGRESS.match(first_word):
        found.append("a work-in-progress commit: finish it or squash it before submitting")
    else:
        if not scope and not subject[:1].isupper():
            found.append("the subject starts with a lowercase letter (or add a 'scope: ' prefix)")
        if first_word.lower() in NOT_IMPERATIVE:
            hint = "use the imperative ('Add', 'Fix', 'Make')"
            found.append(f"the subject starts with '{first_word}': {hint}")
    if len(lines) > 1 and lines[1].strip():
        found.append("the second line is not blank: separate the subject from the body")
    for trailer in GHSTACK_TRAILERS:
        count = sum(line.startswith(f"{trailer}: ") for line in lines[1:])
        if count > 1:
            found.append(
                f"{count} '{trailer}:' trailers (a squash of two submitted commits): "
                "keep only the one of the pull request this commit updates"
            )
    return found


def git(*args: str) -> str:
    """Run git in the current directory; raise with git's own message if it fails."""
    result = subprocess.run(["git", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"check_commit_msg: git {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout


def log_args(revisions: list[str]) -> list[str]:
    """The ``git log`` arguments that select ``revisions``, ranges or single commits.

    A range from the null commit (a push that created the branch) selects only its tip.
    """
    args = []
    for revision in revisions:
        base, dots, tip = revision.partition("..")
        if dots and base == NULL_SHA:
            args += ["--no-walk", tip]
        else:
            args.append(revision)
    return args


def pull_request_revisions(head_ref: str, revision_range: str) -> list[str]:
    """What CI checks for a pull request whose head branch is ``head_ref``.

    For a ghstack pull request, the contributor's commit: the tip of its ``orig`` branch
    (fetched by ``actions/checkout`` with ``fetch-depth: 0``). Otherwise ``revision_range``.
    """
    match = GHSTACK_HEAD_REF.fullmatch(head_ref)
    if match is None:
        return [revision_range]
    orig = f"origin/gh/{match['user']}/{match['number']}/orig"
    return [f"{orig}^!"]


def commit_messages(revisions: list[str]) -> list[tuple[str, str]]:
    """``(sha, message)`` of every commit ``revisions`` select, oldest first."""
    out = git("log", "--reverse", "-z", "--format=%H%n%B", *log_args(revisions), "--")
    records = [record for record in out.split("\0") if record.strip()]
    return [tuple(record.lstrip("\n").split("\n", 1)) for record in records]  # type: ignore[misc]


def report(commits: list[tuple[str, str]]) -> int:
    """Print one line per problem, naming the commit; return the number of bad commits."""
    bad = 0
    for sha, message in commits:
        found = problems(message)
        bad += bool(found)
        subject = message.strip().splitlines()[0] if message.strip() else ""
        for problem in found:
            print(f"{sha[:10]} {subject!r}: {problem}")
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "revisions", nargs="*", help="git log revision ranges (default: origin/main..HEAD)"
    )
    parser.add_argument(
        "--pull-request",
        nargs=2,
        metavar=("HEAD_REF", "RANGE"),
        help="CI: the pull request's head branch name and its BASE_SHA..HEAD_SHA range",
    )
    args = parser.parse_args(argv)
    if args.pull_request and args.revisions:
        parser.error("give either --pull-request or revision ranges, not both")
    revisions = (
        pull_request_revisions(*args.pull_request)
        if args.pull_request
        else args.revisions or ["origin/main..HEAD"]
    )
    commits = commit_messages(revisions)
    bad = report(commits)
    if bad:
        print(f"{bad} of {len(commits)} commit messages break the rules in CONTRIBUTING.md")
        return 1
    print(f"{len(commits)} commit messages checked: all follow CONTRIBUTING.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
