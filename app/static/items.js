// Several items in one photo: each item's box drawn on the photo with its label, and a card
// per item with its rules. The events are docs/api.md's `items`, `item`, `item_rule`; `done`
// carries the same `items` and `item_rules` and is authoritative. A photo of one item keeps
// the page's single-item cards only.

const $ = (id) => document.getElementById(id);
const card = () => $("items-card");

let photoUrl = null;

function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = text;
  if (className) node.className = className;
  return node;
}

function categoryOf(c) {
  return c ? [c.major, c.middle].filter(Boolean).join(" › ") : "";
}

// The photo as sent (the boxes are shares of it), shown once a photo of several is known.
export function resetItems(blob) {
  card().hidden = true;
  $("items-boxes").replaceChildren();
  $("items-list").replaceChildren();
  if (photoUrl) URL.revokeObjectURL(photoUrl);
  photoUrl = blob ? URL.createObjectURL(blob) : null;
  if (photoUrl) $("items-img").src = photoUrl;
}

function entryFor(index) {
  let li = $("items-list").querySelector(`[data-index="${index}"]`);
  if (!li) {
    li = el("li", null, "item-entry");
    li.dataset.index = String(index);
    $("items-list").append(li);
  }
  return li;
}

export function showItem(item) {
  card().hidden = false;
  const label = item.item_name || categoryOf(item.classification);
  const li = entryFor(item.index);
  li.replaceChildren(
    el("p", `${item.index + 1}. ${label}${item.main ? " (주 품목)" : ""}`, "item-title"),
    el("p", categoryOf(item.classification), "category"),
  );
  li.append(el("div", null, "item-rule"));
  const boxes = $("items-boxes");
  boxes.querySelector(`[data-index="${item.index}"]`)?.remove();
  if (!item.box) return;
  const frame = el("div", null, item.main ? "item-box main" : "item-box");
  if (item.box.x + item.box.width / 2 > 0.6) frame.classList.add("right");
  frame.dataset.index = String(item.index);
  const { x, y, width, height } = item.box;
  Object.assign(frame.style, {
    left: `${x * 100}%`,
    top: `${y * 100}%`,
    width: `${width * 100}%`,
    height: `${height * 100}%`,
  });
  frame.append(el("span", `${item.index + 1}. ${label}`, "item-label"));
  boxes.append(frame);
}

export function showItemRule(itemRule) {
  const rule = entryFor(itemRule.index).querySelector(".item-rule") || entryFor(itemRule.index);
  const rules = itemRule.disposal_rules;
  rule.replaceChildren();
  if (!rules) {
    rule.append(el("p", itemRule.reason || "배출 규정을 찾지 못했어요.", "hint"));
    return;
  }
  rule.append(el("p", rules.title, "rule-title"));
  if (rules.summary) rule.append(el("p", rules.summary));
  const steps = [...(rules.preparation || []), ...(rules.disposal || [])];
  if (steps.length) {
    const ol = document.createElement("ol");
    for (const step of steps) ol.append(el("li", step));
    rule.append(ol);
  }
}

export function showItemsFromDone(data) {
  const items = data.items || [];
  if (items.length < 2) return;
  for (const item of items) showItem(item);
  for (const itemRule of data.item_rules || []) showItemRule(itemRule);
}
