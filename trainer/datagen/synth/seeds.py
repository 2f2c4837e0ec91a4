"""The seed lists the prompt generator draws from: topics, kinds of request, and who asks.

Plain data. A category whose name is also a chatterbot category (``ai``, ``computers``,
``emotion``, ``food``, ``history``, ``money``, ``movies``, ``politics``, ``psychology``,
``science``, ``sports``, ``literature``, ``health``, ``humor``, ``greetings``) is left out
when that chatterbot category is held out (``--holdout-categories``), so synthetic prompts
never cover a held-out topic on purpose.
"""

from __future__ import annotations

CATEGORIES: dict[str, str] = {
    "ai": "artificial intelligence, chatbots and robots",
    "computers": "computers, software and the internet",
    "coding": "programming and writing code",
    "emotion": "feelings, moods and relationships",
    "food": "food, cooking and drinks",
    "history": "history and famous historical events",
    "money": "money, jobs and personal finance",
    "movies": "films, television and actors",
    "music": "music, songs and instruments",
    "politics": "politics, government and laws",
    "psychology": "the mind, habits and behaviour",
    "science": "physics, chemistry, biology and space",
    "sports": "sports, games and athletes",
    "literature": "books, poems and writers",
    "health": "health, fitness and sleep",
    "humor": "jokes and funny things",
    "greetings": "small talk and greetings",
    "travel": "travel, countries and cities",
    "nature": "animals, plants and the weather",
    "math": "arithmetic, numbers and puzzles",
    "language": "words, grammar and learning languages",
    "home": "home, family and everyday chores",
    "school": "school, studying and exams",
    "work": "the workplace, careers and interviews",
    "art": "painting, drawing and design",
}

TASKS: tuple[str, ...] = (
    "a short factual question",
    "a request for an explanation",
    "a request for advice",
    "a request for a list of ideas",
    "a question asking for an opinion",
    "a request to write something short, such as a poem or a message",
    "a how-to question",
    "a question comparing two things",
    "a casual remark to chat about",
    "a request for a definition",
    "a question asking the assistant about itself",
    "a simple math or logic question",
)

PERSONAS: tuple[str, ...] = (
    "a curious child",
    "a high-school student",
    "a university student",
    "a busy parent",
    "a retired teacher",
    "a software developer",
    "a nurse",
    "a small business owner",
    "a traveller",
    "a home cook",
    "a sports fan",
    "a bored teenager",
    "a journalist",
    "a farmer",
    "someone learning English",
)
