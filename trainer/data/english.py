"""Whether a text is English, by two shares (shared by the corpus filters, ``trainer.data.corpora_select``,
and the filters of synthesized prompts, ``trainer.datagen.synth.filters``):

at least ``min_ascii`` of its letters are ASCII letters, at least ``min_stopwords`` of its words
are common English function words (``STOPWORDS``: "what", "is", "the", "you", ...), and it has
more of those than of the commonest German, French, Spanish, Italian and Dutch ones
(``FOREIGN_STOPWORDS``: "der", "ist", "la", "est", "que", ...). English questions and requests
almost always have some; other languages and token soup rarely do. It is a heuristic, not a
language identifier: a terse English prompt with no function word at all ("Recommend good
sci-fi books") fails it too.
"""

from __future__ import annotations

from trainer.data.dedup import words

STOPWORDS = frozenset(
    "a an the and or but if of to in on at for with about from by as into than then so "
    "is are was were be been being am do does did have has had can could will would should may might must "
    "i me my we our you your he she it its they them their this that these those there here "
    "what which who whom whose when where why how not no yes all any some more most very just also".split()
)

FOREIGN_STOPWORDS = frozenset(
    "der die das und ist nicht ein eine mit von zu ich sie wir ihr wie warum wo auch "
    "le la les et est une des du pour pas sur dans qui je vous nous quoi pourquoi comment "
    "el los las y es que por para del una con se lo como qué cuál dónde "
    "il che di sono della per non gli perché dove "
    "het een niet ik je wat waarom hoe".split()
)


def is_english(text: str, min_ascii: float, min_stopwords: float) -> bool:
    """``text`` passes both shares (``min_stopwords`` 0: the function-word check is off)."""
    letters = [c for c in text if c.isalpha()]
    if not letters or sum(c.isascii() for c in letters) < min_ascii * len(letters):
        return False
    if min_stopwords == 0:
        return True
    w = words(text)
    english = sum(x in STOPWORDS for x in w)
    return english >= min_stopwords * len(w) and english > sum(x in FOREIGN_STOPWORDS for x in w)
