"""A serving gateway as the second story and the serving eye's tests need one: a bounded load generator sending
OpenAI chat-completions requests one at a time to a server on 127.0.0.1, writing each request to a JSONL request log
with its timestamp as a gateway does, and two kinds of traffic: the shipped chat prompts (what the drafter was
trained on) and prompts in languages it never saw.

Why other languages for the new kind, not code or structured data: measured offline on the shipped base drafter (64
new tokens, k=3, float32, 2-core AMD EPYC, 2026-12-03), the shipped chat prompts gave an acceptance length of 2.07,
pasted JSON / CSV / log-line tasks 1.68-1.76 (the shipped prompts already hold code and the target copies data
well), French 1.36 and German 1.49: a new language is the shift this drafter does not survive."""

from __future__ import annotations

import json
import random
import time
import urllib.request
from pathlib import Path

from eagle3_assets.sources.prompt_files import SINGLE_TURN, LoadStats, load_source

OTHER_LANGUAGES = [
    "Pourquoi le ciel est-il bleu pendant la journée et rouge le soir ?",
    "Peux-tu m'expliquer comment fonctionne la photosynthèse chez les plantes ?",
    "Donne-moi trois conseils pour mieux dormir quand on travaille de nuit.",
    "Quelle est la différence entre un virus et une bactérie ?",
    "Écris un court poème sur l'automne à Paris.",
    "Comment préparer une bonne pâte à crêpes pour quatre personnes ?",
    "Explique-moi la théorie de la relativité avec des mots simples.",
    "Quels sont les avantages et les inconvénients du télétravail ?",
    "Raconte-moi une histoire courte sur un chat perdu dans la ville.",
    "Comment apprendre une langue étrangère rapidement quand on a peu de temps ?",
    "Qu'est-ce qu'une fonction récursive et pourquoi est-elle utile ?",
    "Quels sont les principaux monuments à visiter à Rome en deux jours ?",
    "Comment économiser de l'argent chaque mois avec un petit salaire ?",
    "Pourquoi les feuilles des arbres changent-elles de couleur en automne ?",
    "Décris les étapes pour planter un pommier dans son jardin.",
    "Quelle est l'histoire de la construction de la tour Eiffel ?",
    "Comment fonctionne un moteur électrique dans une voiture ?",
    "Quels aliments faut-il manger pour avoir plus d'énergie le matin ?",
    "Écris une lettre pour remercier un professeur à la fin de l'année.",
    "Pourquoi la mer est-elle salée alors que les rivières ne le sont pas ?",
    "Warum ist der Himmel blau und nicht grün?",
    "Wie funktioniert ein Kühlschrank, einfach erklärt?",
    "Gib mir drei Tipps, wie ich besser für eine Prüfung lerne.",
    "Was ist der Unterschied zwischen Wetter und Klima?",
    "Schreibe ein kurzes Gedicht über den ersten Schnee im Winter.",
    "¿Por qué los gatos duermen tantas horas al día?",
    "¿Cómo se prepara una tortilla de patatas tradicional?",
    "Explícame qué es la inflación y por qué sube los precios.",
    "¿Cuáles son los planetas del sistema solar y cuál es el más grande?",
    "Escribe un cuento corto sobre un perro que aprende a nadar.",
]


# Many more of the new kind, for a retraining to learn from: questions built from templates and topics, in the
# three languages above (distinct prompts, not near copies of each other at the traffic's dedup threshold).
_TEMPLATES = {
    "fr": ["Explique-moi simplement {t}.", "Pourquoi {t} est-il important aujourd'hui ?",
           "Donne-moi trois faits surprenants sur {t}.", "Comment expliquer {t} à un enfant de dix ans ?",
           "Quelle est l'histoire de {t} en quelques phrases ?", "Quels sont les avantages et les limites de {t} ?"],
    "es": ["Explícame de forma sencilla {t}.", "¿Por qué es importante {t} hoy en día?",
           "Dame tres datos curiosos sobre {t}."],
    "de": ["Erkläre mir einfach {t}.", "Warum ist {t} heute wichtig?", "Nenne mir drei überraschende Fakten über {t}."],
}
_TOPICS = {
    "fr": ["la photosynthèse", "le cycle de l'eau", "la Révolution française", "l'intelligence artificielle",
           "le système solaire", "la gravité", "le vaccin contre la grippe", "l'économie circulaire", "le jazz",
           "la tectonique des plaques", "le réchauffement climatique", "la démocratie", "le sommeil des animaux",
           "la cuisine lyonnaise", "le marathon", "les abeilles", "la monnaie", "le cinéma muet", "les volcans",
           "la mémoire humaine"],
    "es": ["la fotosíntesis", "el ciclo del agua", "la inteligencia artificial", "el sistema solar", "los volcanes",
           "la democracia", "las abejas", "el flamenco"],
    "de": ["die Photosynthese", "der Wasserkreislauf", "die künstliche Intelligenz", "das Sonnensystem",
           "die Vulkane", "die Demokratie", "die Bienen", "der Jazz"],
}


# The second turn's new kind: Italian and Portuguese, which neither the shipped drafter nor a retraining on the
# first kind learned from.
_TEMPLATES_2 = {
    "it": ["Spiegami in modo semplice {t}.", "Perché {t} è importante oggi?", "Descrivi {t} in tre frasi.",
           "Come spiegheresti {t} a un bambino di dieci anni?", "Che cosa devo sapere per capire {t}?",
           "Scrivi un breve paragrafo che presenti {t}."],
    "pt": ["Explica-me de forma simples {t}.", "Porque é importante estudar {t}?", "Dá-me três curiosidades sobre {t}.",
           "Como explicarias {t} a uma criança de dez anos?"],
}
_TOPICS_2 = {
    "it": ["la fotosintesi", "il ciclo dell'acqua", "il Rinascimento", "l'intelligenza artificiale", "il sistema solare",
           "la gravità", "l'economia circolare", "la tettonica delle placche", "il cambiamento climatico",
           "la democrazia", "le api", "la cucina napoletana", "il calcio", "la memoria umana", "i vulcani",
           "l'opera lirica"],
    "pt": ["a fotossíntese", "o ciclo da água", "a inteligência artificial", "o sistema solar", "os vulcões",
           "a democracia", "as abelhas", "o fado", "a Amazónia", "o futebol"],
}
KINDS = {"fr-es-de": (_TEMPLATES, _TOPICS), "it-pt": (_TEMPLATES_2, _TOPICS_2)}


def other_language_prompts(n: int, kind: str = "fr-es-de") -> list[str]:
    """Up to n generated prompts of a new kind of traffic, in a fixed shuffled order: `fr-es-de` (168: French,
    Spanish and German) or `it-pt` (136: Italian and Portuguese)."""
    templates, topics = KINDS[kind]
    out = [tpl.format(t=topic) for lang in templates for topic in topics[lang] for tpl in templates[lang]]
    random.Random(0).shuffle(out)
    return out[:n]


def chat_prompts(n: int) -> list[str]:
    """The shipped single-turn chat prompts (explanations, advice, trivia) the base drafter was trained on: 1.93, 2.33
    and 1.97 offline (12 prompts each, as above), where its creative writing gave 1.84."""
    convs = load_source(SINGLE_TURN, max_user_turns=1, max_message_chars=8000, on_bad_record="fail", stats=LoadStats())
    kinds = ("st-explanations", "st-advice", "st-trivia")
    prose = [c.messages[-1]["content"] for c in convs if c.id.startswith(kinds)]
    return prose[::7][:n]  # spread over the kinds


class Gateway:
    """Sends chat requests to `url` one at a time, each logged to `log` (JSONL) with its response once it is answered,
    as a gateway's access log holds them: the request's time, its route, the request body and the response body
    (which carries vLLM's per-request speculative figures when the server is started with
    --per-request-spec-decode-metrics)."""

    def __init__(self, url: str, log: Path, max_tokens: int = 64):
        self.url, self.log, self.max_tokens, self.sent = url, log, max_tokens, 0

    def send(self, text: str, log: bool = True) -> dict:
        """One request; `log=False`: a monitor's probe, which the gateway's log (the traffic) never holds."""
        body = {"model": "target", "messages": [{"role": "user", "content": text}], "max_tokens": self.max_tokens,
                "temperature": 0}
        t = time.time()
        req = urllib.request.Request(f"{self.url}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=180) as r:
            assert r.status == 200
            response = json.loads(r.read())
        self.sent += 1
        if log:
            with open(self.log, "a") as f:
                f.write(json.dumps({"timestamp": t, "route": "/v1/chat/completions", "body": body,
                                    "response": response}) + "\n")
        return response
