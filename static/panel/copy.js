// Copy buttons: <button data-copy="ID"> copies the text of the element with that id. The Clipboard API
// needs a secure context (https or localhost); a panel on plain http elsewhere gets a selection and
// execCommand("copy") instead, which browsers still allow from a click.
(function () {
  function fallback(el) {
    const range = document.createRange();
    range.selectNodeContents(el);
    const selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
    let ok = false;
    try { ok = document.execCommand("copy"); } catch (e) { ok = false; }
    return ok;
  }
  document.addEventListener("click", async (event) => {
    const button = event.target.closest("button[data-copy]");
    if (!button) return;
    const el = document.getElementById(button.dataset.copy);
    if (!el) return;
    let ok = false;
    if (navigator.clipboard && window.isSecureContext) {
      try { await navigator.clipboard.writeText(el.textContent); ok = true; } catch (e) { ok = false; }
    }
    if (!ok) ok = fallback(el);
    const label = button.dataset.label || button.textContent;
    button.dataset.label = label;
    button.textContent = ok ? "Copied" : "Select and copy";
    setTimeout(() => { button.textContent = label; }, 1500);
  });
})();
