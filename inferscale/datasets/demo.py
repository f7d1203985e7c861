"""A small built-in conversation for ``inferscale demo`` (works without any data set)."""

from inferscale.encode.window import Turn

USER = "maya"

TURNS = [
    Turn("D1:1", "Maya", "Hi! I just moved to Lisbon last month for a new job."),
    Turn("D1:2", "Assistant", "Welcome to Lisbon! What is the new job?"),
    Turn("D1:3", "Maya", "I'm a marine biologist at the city aquarium. I take care of the octopus exhibit."),
    Turn("D1:4", "Assistant", "That sounds fascinating. Do you have pets?"),
    Turn("D1:5", "Maya", "Yes, a grey cat called Pixel. She is eight years old and hates the tram."),
    Turn("D1:6", "Assistant", "Ha! How do you spend your weekends?"),
    Turn("D1:7", "Maya", "Surfing at Costa da Caparica, and I'm learning Portuguese on Tuesdays."),
    Turn("D1:8", "Assistant", "Any food you love or avoid?"),
    Turn("D1:9", "Maya", "I'm vegetarian and allergic to peanuts. My favourite dish is a mushroom risotto."),
    Turn("D1:10", "Maya", "My sister Ana lives in Porto; I visit her every first weekend of the month."),
]

FACTS = [
    ("Maya moved to Lisbon last month for a new job.", "D1:1"),
    ("Maya is a marine biologist at the city aquarium.", "D1:3"),
    ("Maya takes care of the octopus exhibit.", "D1:3"),
    ("Maya has a grey cat called Pixel.", "D1:5"),
    ("Pixel is eight years old and hates the tram.", "D1:5"),
    ("Maya surfs at Costa da Caparica on weekends.", "D1:7"),
    ("Maya takes Portuguese lessons on Tuesdays.", "D1:7"),
    ("Maya is vegetarian.", "D1:9"),
    ("Maya is allergic to peanuts.", "D1:9"),
    ("Maya's favourite dish is mushroom risotto.", "D1:9"),
    ("Maya's sister Ana lives in Porto.", "D1:10"),
    ("Maya visits her sister every first weekend of the month.", "D1:10"),
]

#: question → the word an answer must contain to be right
QUESTIONS = {
    "What is the name of my cat?": "Pixel",
    "Which city does my sister live in?": "Porto",
    "What am I allergic to?": "peanut",
    "Where do I go surfing?": "Caparica",
}
