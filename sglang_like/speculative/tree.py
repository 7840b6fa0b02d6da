"""DraftTree: the tokens one verify pass checks for one request, as a tree rooted at the
request's last committed token."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    """Node 0 is the root (the request's last token, whose K/V is not computed yet); every
    other node is a drafted continuation of its parent. Parents precede children.

    A verify pass runs all N nodes in one forward: node j sits at position seq_len - 1 +
    depth[j] and attends to the committed prefix and to its ancestors (`mask`, diagonal set).
    """

    tokens: list[int]
    parents: list[int]  # parents[0] == -1
    # what the drafter based it on, for the controller's expectation (NGRAM: the matched
    # suffix length); None: nothing to say
    evidence: int | None = None
    # a confident drafter's (EAGLE) probability of each node's path (root: 1), nodes listed
    # most likely first; None: not given
    probs: list[float] | None = None
    # a confident drafter's tree with a cheap drafter's trie grafted on (`with_copies`):
    # which nodes the cheap drafter drafted (the `evidence` is its), and each node's expected
    # share of a token as the controller priced it (nodes listed by it); None: not grafted
    copied: list[bool] | None = None
    expected: list[float] | None = None
    depth: list[int] = field(init=False)
    _children: list[dict[int, int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.tokens or self.parents[0] != -1 or len(self.parents) != len(self.tokens):
            raise ValueError("a draft tree needs a root (parent -1) and a parent per node")
        self.depth = [0] * len(self.tokens)
        self._children = [{} for _ in self.tokens]
        for j in range(1, len(self.tokens)):
            p = self.parents[j]
            if not 0 <= p < j:
                raise ValueError(f"node {j}: parent {p} does not precede it")
            self.depth[j] = self.depth[p] + 1
            # one child per token: a duplicate would be verified twice for nothing
            self._children[p].setdefault(self.tokens[j], j)

    @classmethod
    def chain(cls, root: int, drafts: list[int]) -> DraftTree:
        return cls([root, *drafts], list(range(-1, len(drafts))))

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    def child(self, node: int, token: int) -> int | None:
        """The child of `node` drafted as `token`, if any."""
        return self._children[node].get(token)

    def paths(self) -> list[list[int]]:
        """Each node's tokens from the root's child down to it (the root's: none): what the
        request has output past its last token once a walk reaches the node."""
        out: list[list[int]] = [[]]
        for j in range(1, self.num_nodes):
            out.append(out[self.parents[j]] + [self.tokens[j]])
        return out

    def mask(self) -> torch.Tensor:
        """bool [N, N]: node i sees node j iff j is i or an ancestor of i."""
        n = self.num_nodes
        m = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                m[i, j] = True
                j = self.parents[j]
        return m

    def first(self, num_nodes: int) -> DraftTree:
        """The first `num_nodes` nodes (a subtree: parents precede children)."""
        if num_nodes >= self.num_nodes:
            return self
        def cut(values: list | None) -> list | None:
            return None if values is None else values[:num_nodes]

        return DraftTree(self.tokens[:num_nodes], self.parents[:num_nodes], self.evidence,
                         cut(self.probs), cut(self.copied), cut(self.expected))

    def truncated(self, max_depth: int) -> DraftTree:
        """The nodes at depth <= max_depth (parents stay before children)."""
        keep = [j for j in range(self.num_nodes) if self.depth[j] <= max_depth]
        if len(keep) == self.num_nodes:
            return self
        new_index = {old: new for new, old in enumerate(keep)}
        return DraftTree([self.tokens[j] for j in keep],
                         [-1 if self.parents[j] < 0 else new_index[self.parents[j]]
                          for j in keep])


def with_copies(tree: DraftTree | None, copies: DraftTree, copy_probs: list[float],
                calibration: float) -> DraftTree:
    """A confident drafter's tree (`probs` given; None: none) with a cheap drafter's trie
    `copies` grafted at the root (the two share it), a node both drafted kept once.

    Each node is expected to commit the larger of its two chances: the head's probability
    scaled by `calibration` (accepted drafts per unit of it, as measured), and `copy_probs`
    (the controller's price of the cheap drafter's node, from what its evidence committed).
    Nodes are listed by that, most likely first (a child never above its parent), so the
    controller's first m nodes are the m most likely and a subtree."""
    if tree is None:
        tokens, parents, head, depth = [copies.tokens[0]], [-1], [1.0], [0]
    else:
        tokens, parents, depth = list(tree.tokens), list(tree.parents), list(tree.depth)
        head = list(tree.probs) if tree.probs is not None else [1.0] + [0.0] * (len(tokens) - 1)
    copied = [False] * len(tokens)
    copy_p = [0.0] * len(tokens)
    children = {(parents[j], tokens[j]): j for j in range(1, len(tokens))}
    at = {0: 0}  # node of `copies` -> node here
    for j in range(1, copies.num_nodes):
        parent = at[copies.parents[j]]
        node = children.get((parent, copies.tokens[j]))
        if node is None:
            node = children[(parent, copies.tokens[j])] = len(tokens)
            tokens.append(copies.tokens[j])
            parents.append(parent)
            depth.append(depth[parent] + 1)
            head.append(0.0)
            copied.append(False)
            copy_p.append(0.0)
        at[j] = node
        copied[node] = True
        copy_p[node] = max(copy_p[node], copy_probs[j])
    expected = [1.0]
    for j in range(1, len(tokens)):  # parents precede children: a child never above its parent
        expected.append(min(expected[parents[j]],
                            max(min(1.0, calibration * head[j]), copy_p[j])))
    order = [0, *sorted(range(1, len(tokens)), key=lambda j: (-expected[j], depth[j], j))]
    new = {old: i for i, old in enumerate(order)}
    return DraftTree([tokens[j] for j in order],
                     [-1 if j == 0 else new[parents[j]] for j in order],
                     evidence=copies.evidence, probs=[head[j] for j in order],
                     copied=[copied[j] for j in order], expected=[expected[j] for j in order])
